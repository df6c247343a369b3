"""Elastic membership through a real daemon (issue 37): simulated workers follow `afd-ctl scale`
from 1:1 to 2:1, 2:2, 1:2 and back to 1:1 while the attention side publishes steps the whole
time. Every step of attention rank 0 reaches FFN rank 0 in order, none lost, across every
change; leaving workers are retired and exit 0; the hold at each change is reported. Bad
targets and a scale during another change are refused in one line.

The workers are afd_ctl.sim_worker processes: real registrations, payloads and acks, no model
(vLLM workers follow planned changes when sized for them: tests/test_vllm_elastic.py; a
worker of a fixed size is refused, tests/test_control_scaling.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from tests.procs import Daemon, Proc, afd_ctl, child_env, sim_worker

WAIT_S = 30.0


def status(daemon: Daemon) -> afd_pb2.Status:
    with grpc.insecure_channel(daemon.address) as channel:
        return afd_pb2_grpc.AFDInspectStub(channel).GetStatus(afd_pb2.GetStatusRequest(), timeout=5)


def wait_status(daemon: Daemon, what: str, check, timeout: float = WAIT_S) -> afd_pb2.Status:
    deadline = time.monotonic() + timeout
    while True:
        s = status(daemon)
        if check(s):
            return s
        assert time.monotonic() < deadline, f"{what} within {timeout} s: {s}"
        time.sleep(0.05)


def sim(procs: list[Proc], tmp_path: Path, daemon: Daemon, role: str, name: str, *args: str):
    proc = sim_worker(
        tmp_path / f"{name}.log",
        daemon.address,
        role,
        "--worker-id",
        name,
        "--steps",
        "0",
        "--attention-dp-size",
        "0",
        "--timeout",
        "60",
        *args,
    )
    procs.append(proc)
    return proc


def scale_and_start(daemon, attention, ffn, start=lambda: None, *flags: str) -> float:
    """`afd-ctl scale`, then the new workers; waits for the new epoch; returns the hold (s)."""
    before = status(daemon).steps_relayed
    out = afd_ctl(daemon.address, "scale", "--attention", str(attention), "--ffn", str(ffn), *flags)
    assert out.returncode == 0, out.stderr
    if flags:  # --wait-s: it followed the change to its new epoch
        assert "scaled from" in out.stdout and f" to {attention}:{ffn} " in out.stdout, out.stdout
    start()
    done = wait_status(
        daemon,
        f"the move to {attention}:{ffn}",
        lambda s: not s.HasField("change") and s.current.attention == attention,
    )
    assert done.last_change.startswith("scaled from"), done.last_change
    assert done.current.ffn == ffn and done.health == "SERVING"
    record = done.epoch_history[-1]
    assert record.epoch == done.epoch and record.reason.startswith(f"scaled to {attention}:{ffn}")
    # Steps flow again in the new epoch.
    wait_status(daemon, "steps after the change", lambda s: s.steps_relayed > before + 20)
    return record.pause_s


def test_sim_workers_follow_scale_from_1_1_to_2_1_2_2_1_2_and_back(start_daemon, procs, tmp_path):
    daemon = start_daemon("--metrics-port", "-1", "--fence-timeout-s", "20")
    port = int(daemon.wait_for(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", 10).group(1))
    # Its data plane (were it a real one) is sized for at most 2 attention ranks.
    a0 = sim(procs, tmp_path, daemon, "attention", "a0", "--rate", "100", "--max-attention", "2")
    f0 = sim(procs, tmp_path, daemon, "ffn", "f0")
    wait_status(daemon, "steps", lambda s: s.health == "SERVING" and s.steps_relayed > 20)

    pauses = {}
    a1: list[Proc] = []
    f1: list[Proc] = []
    start_a1 = lambda: a1.append(  # noqa: E731
        sim(
            procs,
            tmp_path,
            daemon,
            "attention",
            "a1",
            "--dp-rank",
            "1",
            "--dp-size",
            "2",
            "--rate",
            "100",
        )
    )
    pauses["1:1->2:1"] = scale_and_start(daemon, 2, 1, start_a1)

    # A second scale while FFN rank 1 has not registered yet: refused, one line; then 2:2.
    out = afd_ctl(daemon.address, "scale", "--attention", "2", "--ffn", "2")
    assert out.returncode == 0 and "waiting for ffn rank 1 to register" in out.stdout
    refused = afd_ctl(daemon.address, "scale", "--attention", "1", "--ffn", "2")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "FAILED_PRECONDITION: a change to 2:2 (2 ffn groups of 1) is in progress" in (
        refused.stderr
    )
    daemon.wait_for(r"scale refused: to 1:2 from .*: FAILED_PRECONDITION: a change to 2:2", 5)
    text = afd_ctl(daemon.address, "status").stdout
    assert (
        "target      2:2 (2 ffn groups of 1): gather" in text and "waiting for ffn rank 1" in text
    )
    start_f1 = lambda: f1.append(  # noqa: E731
        sim(procs, tmp_path, daemon, "ffn", "f1", "--dp-rank", "1", "--dp-size", "2")
    )
    pauses["2:1->2:2"] = scale_and_start(daemon, 2, 2, start_f1)

    # (no worker to start: it completes once attention rank 1 drained; --wait-s follows it)
    pauses["2:2->1:2"] = scale_and_start(daemon, 1, 2, lambda: None, "--wait-s", "30")
    assert a1[0].wait(WAIT_S) == 0  # drained, retired, exits
    left = a1[0].json_report(5)
    assert "retired" in left["stopped"] and left["published"] > 0

    pauses["1:2->1:1"] = scale_and_start(daemon, 1, 1)
    assert f1[0].wait(WAIT_S) == 0
    ffn1 = f1[0].json_report(5)
    assert ffn1["problems"] == [] and "retired" in ffn1["stopped"]

    # Bad targets: one line naming the rule, nothing changes.
    for args, rule in (
        (("--attention", "1", "--ffn", "4", "--expert-parallel-size", "3"), "rule: E divides N"),
        (("--attention", "1", "--ffn", "4", "--expert-parallel-size", "2"), "must not exceed"),
    ):
        bad = afd_ctl(daemon.address, "scale", *args)
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and rule in bad.stderr
        assert "INVALID_ARGUMENT" in bad.stderr
    big = afd_ctl(daemon.address, "scale", "--attention", "3", "--ffn", "1")
    assert big.returncode == 1 and big.stderr.count("\n") == 1, big.stderr
    assert "FAILED_PRECONDITION: attention rank 0 (a0) cannot follow 3:1" in big.stderr

    text = afd_ctl(daemon.address, "status").stdout
    assert "membership  1:1 (1 ffn group of 1)" in text and "last change scaled from" in text
    assert "EPOCH" in text and "scaled to 1:1" in text
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'afd_ctl_scale_changes_total{outcome="scaled"} 4.0' in metrics
    assert 'afd_ctl_workers_target{role="attention"} 1.0' in metrics
    assert "afd_ctl_change_in_progress 0.0" in metrics
    kinds = [afd_pb2.MembershipEvent.Kind.Name(e.kind) for e in status(daemon).recent_events]
    assert {"TARGET_SET", "FENCE", "SCALED", "RETIRED"} <= set(kinds)

    # The end: every step attention rank 0 published reached FFN rank 0, in order.
    assert afd_ctl(daemon.address, "stop").returncode == 0
    assert f0.wait(WAIT_S) == 0, f0.tail()
    ffn0 = f0.json_report(5)
    a0.wait(WAIT_S)
    attention0 = a0.json_report(5)
    assert ffn0["problems"] == [], ffn0["problems"]  # no step missing, repeated or reordered
    # (The last few may be published after afd-ctl stop reached FFN rank 0.)
    assert "last_step" in attention0, attention0
    assert 0 <= attention0["last_step"] - ffn0["last_by_sender"]["0"] < 20
    assert ffn0["last_by_sender"]["0"] > 100
    print("hold at each change (ms):", {k: round(v * 1e3, 1) for k, v in pauses.items()})
    assert all(0 < pause < 5 for pause in pauses.values()), pauses
    assert re.search(r"epochs", str(attention0)) and len(attention0["epochs"]) >= 5


def test_a_scale_the_frozen_daemon_never_answered_is_asked_again_and_the_stall_logged(
    start_daemon, tmp_path
):
    """A daemon that cannot run calls for a while (frozen here; on a host, starved or
    swapping) drops a Scale whose deadline passes first, unanswered. With --wait-s the CLI asks
    again until it is answered (the same target never starts a second change), and the daemon's
    log says how long its event loop was held."""
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    daemon.signal(signal.SIGSTOP)
    try:
        asking = subprocess.Popen(
            [sys.executable, "-m", "afd_ctl.cli", "scale", "--attention", "1", "--ffn", "1",
             "--timeout", "1", "--wait-s", "30", "--controller", daemon.address],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        assert asking.stderr is not None
        # Frozen through three unanswered calls (the first may fail at once, the others wait
        # out --timeout): at least two seconds.
        said = [asking.stderr.readline() for _ in range(3)]
        assert all("the daemon did not answer" in s and "asking again" in s for s in said), said
    finally:
        daemon.signal(signal.SIGCONT)
    out, err = asking.communicate(timeout=30)
    assert asking.returncode == 0, (out, err)
    assert "1:1 (1 ffn group of 1): nothing to change" in out, out
    daemon.wait_for(r"the daemon's event loop was held for \d+\.\d s", 10)
