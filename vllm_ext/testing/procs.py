"""Command lines and environment for real vLLM processes in tests, the demo and benchmarks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_ext.testing.offline import CPU_ATTENTION_BACKEND, CPU_ENV

# Same engine settings for every side so that colocated and AFD runs are comparable.
# --max-num-batched-tokens sizes the data plane, which both roles must agree on: explicit here
# because vLLM's default differs between `vllm serve` and the offline LLM() the tests also use.
ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "256",
    "--seed",
    "0",
    "--max-num-batched-tokens",
    "512",
]
if CPU_ATTENTION_BACKEND:  # see offline.CPU_ATTENTION_BACKEND
    ENGINE_FLAGS += ["--attention-backend", CPU_ATTENTION_BACKEND]


def bin_path(name: str) -> str:
    """A console script of the running interpreter's environment (vllm, afd-ctl)."""
    return str(Path(sys.executable).with_name(name))


def vllm_env(extra: dict[str, str] | None = None, *, in_process: bool = False) -> dict[str, str]:
    """CPU settings for reproducible greedy outputs (offline.CPU_ENV says why each)."""
    env = {k: v for k, v in CPU_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def engine_flags(eager: bool = True) -> list[str]:
    """ENGINE_FLAGS, or without --enforce-eager: vLLM's default path (torch.compile)."""
    return ENGINE_FLAGS if eager else [f for f in ENGINE_FLAGS if f != "--enforce-eager"]


def ffn_argv(model: str | Path, controller: str, *extra: str, eager: bool = True) -> list[str]:
    return [
        bin_path("vllm"),
        "serve",
        str(model),
        "--afd-role",
        "ffn",
        "--afd-controller",
        controller,
        *engine_flags(eager),
        *extra,
    ]


def serve_argv(model: str | Path, port: int, *extra: str, eager: bool = True) -> list[str]:
    return [
        bin_path("vllm"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_flags(eager),
        "--max-num-seqs",
        "8",
        *extra,
    ]


def offline_argv(model: str | Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm_ext.testing.offline", str(model), *extra]


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)  # a refused connection costs nothing; a start is seen 0.2 s sooner
    raise AssertionError(f"{url} not healthy within {timeout_s} s")


def post_json(url: str, body: dict, timeout_s: float = 60) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


_HANDED_OUT: set[int] = set()
_PORTS_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, for a server started next. Below the kernel's ephemeral range:
    a port from bind(0) is one an outgoing connection (a gRPC client, a UCX endpoint) may take
    before the server binds it ("Address already in use", seen in a run of the suite). Random,
    and never the same twice in one process, so servers started side by side do not collide."""
    import socket

    high = min(_ephemeral_low(), 32768) - 1
    if high <= 20000:  # an unusual range: the kernel's pick, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    for _ in range(1000):
        # The OS's randomness: a test seeding Python's `random` must not make two processes
        # (pytest-xdist workers) draw the same ports.
        port = _PORTS_RANDOM.randint(20000, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in 20000-{high} after 1000 tries")


def environ_with(env: dict[str, str]) -> dict[str, str]:
    merged = dict(os.environ)
    merged.update(env)
    return merged
