"""afd-ctl killed with kill -9 while both `vllm serve` roles serve, and started again on the
same port: neither server exits, requests succeed again without restarting either, within
2 x the liveness bound of the restart, and /health never says 200 while a request fails.
Then the two ways afd-ctl goes away on purpose (issue 22, item 1): SIGTERM, a restart both
servers ride out the same way; `afd-ctl stop`, which ends the FFN server (exit 0) and leaves the
attention server up, out of service until a daemon and an FFN server are back, then serving
with no step on it. (ride_out_restarts: run by tests/test_vllm_metrics.py on the pair it
starts anyway, after its own checks: a pair's start is 25-30 s of a 2-core machine.)"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.procs import Daemon, Proc
from tests.test_vllm_failures import (
    AfdServers,
    answered_again,
    http_status,
    post_error,
    stream_and_kill,
    wait_status,
)
from vllm_ext.testing.procs import ffn_argv, vllm_env

LIVENESS_S = 2.0


def kill_daemon_mid_stream(servers: AfdServers) -> tuple[float, float]:
    """kill -9 afd-ctl once a long streamed request's tokens flow; (killed at, stream ended
    at). The stream must end (with an error) instead of hanging on the step that ran."""
    events, killed_at, ended_at = stream_and_kill(servers.url, servers.body, servers.daemon)
    assert killed_at, f"the stream ended before the kill: {events}"
    errors = [e["error"] for e in events if "error" in e]
    assert errors, f"the stream ended without an error: {events[-3:]}"
    # The same type and code as a plain request's 503.
    assert errors[-1]["type"] == "ServiceUnavailableError", errors[-1]
    assert errors[-1]["code"] == 503, errors[-1]
    return killed_at, ended_at


def serving_again(servers: AfdServers, timeout_s: float) -> float:
    """Asks /health and sends a request until one succeeds; /health must not say 200 while
    the request right after it fails. Seconds until the first success."""
    start = time.monotonic()
    while True:
        health = http_status(servers.health)
        status, text = post_error(servers.url, servers.body)
        if status == 200:
            assert json.loads(text)["choices"][0]["text"] == servers.before
            return time.monotonic() - start
        assert health != 200, f"/health said 200, then the request failed: {status} {text}"
        assert status == 503, (status, text)
        assert time.monotonic() - start < timeout_s, f"still failing: {status} {text}"


def ride_out_restarts(
    servers: AfdServers, model: Path, start_daemon: Callable[..., Daemon], procs: list[Proc],
    tmp_path: Path,
) -> None:  # fmt: skip
    """The module docstring's restarts on a serving 1:1 pair (its attention server's worker in
    its engine core's process), each new daemon with the liveness bound LIVENESS_S; the log
    checks at the end count only what happened from here on."""
    from_here = len(servers.attention.log())
    liveness = ["--liveness-timeout-s", str(LIVENESS_S)]
    args = ["--expect-attention", "1", "--expect-ffn", "1", *liveness]
    for outage_s in (0.0, 5.0):
        killed_at, ended_at = kill_daemon_mid_stream(servers)
        # The step running at the kill fails at once, not after its whole step bound.
        assert ended_at - killed_at < 2 * LIVENESS_S, (
            f"the streamed request ended {ended_at - killed_at:.1f} s after the kill"
        )
        # The outage itself is what is tested here, not a wait for something to happen.
        time.sleep(max(0.0, outage_s - (time.monotonic() - killed_at)))
        servers.daemon = start_daemon(*args, listen=servers.daemon.address)
        took = serving_again(servers, timeout_s=60)
        assert took < 2 * LIVENESS_S, f"outage {outage_s} s: serving {took:.1f} s after restart"
        assert servers.ffn.popen.poll() is None, servers.ffn.tail()
        assert servers.attention.popen.poll() is None, servers.attention.tail()

    # SIGTERM: the daemon drains as a restart. Both servers hang up at once (the daemon exits
    # without spending its drain grace), neither exits, and both are back with the next one.
    servers.daemon.signal(signal.SIGTERM)
    assert servers.daemon.wait(10) == 0, servers.daemon.tail()
    assert "drain grace" not in servers.daemon.log()
    wait_status(servers.health, 503, 10)
    servers.daemon = start_daemon(*args, listen=servers.daemon.address)
    took = serving_again(servers, timeout_s=60)
    assert took < 2 * LIVENESS_S, f"after a drain: serving {took:.1f} s after restart"
    assert servers.ffn.popen.poll() is None, servers.ffn.tail()
    assert servers.attention.popen.poll() is None, servers.attention.tail()

    # afd-ctl stop: the deployment shuts down. The FFN server exits 0; the attention server
    # stays up with /health 503 (it was stranded there for good before) ...
    stop = [sys.executable, "-m", "afd_ctl.cli", "stop", "--controller", servers.daemon.address]
    assert Proc(stop, tmp_path / "stop.log").wait(30) == 0
    assert servers.ffn.wait(60) == 0, servers.ffn.tail()
    assert servers.daemon.wait(10) == 0, servers.daemon.tail()
    wait_status(servers.health, 503, 10)
    status, text = post_error(servers.url, servers.body)
    assert status == 503, (status, text)
    # ... and serves again once a daemon and an FFN server are back, with nothing done to it.
    servers.daemon = start_daemon(*args, listen=servers.daemon.address)
    servers.ffn = Proc(ffn_argv(model, servers.daemon.address), tmp_path / "ffn-2.log", vllm_env())
    procs.append(servers.ffn)
    assert answered_again(servers, timeout_s=300) == servers.before
    assert servers.attention.popen.poll() is None, servers.attention.tail()

    # Every failed step above logged one line of its own; vLLM's traceback of it came once per
    # cause and its engine dump at most once a minute (issue 22, item 2: ~9 KB per step).
    from vllm_ext.attention.failure_logs import cause_of

    log = servers.attention.log()[from_here:]
    failures = [
        line for line in log.splitlines() if "[vllm_ext.attention.step_failures] afd: AFD" in line
    ]
    causes = {cause_of(line) for line in failures}
    tracebacks = log.count("WorkerProc hit an exception")
    assert len(failures) > len(causes), failures  # the test made steps fail repeatedly
    # vLLM logs the worker's traceback only where its worker runs in a process of its own
    # (the multiprocessing executor); where it does, once per cause (+ one a minute).
    assert tracebacks <= len(causes) + 1, (tracebacks, causes)
    # vLLM dumps the engine input only on some of its failure paths; where it does, at most
    # once a minute (a fresh-clone run on this machine had none).
    assert log.count("Dumping input data") <= 2, log.count("Dumping input data")
