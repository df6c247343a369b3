"""What one worker's timing reports and trace spans can do to the daemon (issue 39, items 1
and 3): the daemon keeps only the fields it knows, bounds what it stores per worker and in
total, refuses values that cannot be (with the reason), counts warm-up steps apart, and a
trace can neither overflow its start step nor stay locked after a failure.

The unit tests drive the plain-Python timing book; the end-to-end ones send the attack's
reports through a real daemon with the real worker client.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import grpc
import pytest

from afd_ctl.client import ControllerClient
from afd_ctl.config import DaemonConfig
from afd_ctl.controller import Controller
from afd_ctl.fingerprint import ModelFingerprint
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.report_checks import MAX_REPORT_BYTES, known_fields
from afd_ctl.sim_worker import make_payload
from afd_ctl.step_window import StepWindows
from afd_ctl.trace import PendingTrace, check_trace_events, to_chrome
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from tests.procs import afd_ctl

UINT64_MAX = (1 << 64) - 1


def report(first: int, steps: int, tokens: int = 4, compute_s: float = 1e-3, layers: int = 0):
    r = afd_pb2.StepTimings(first_step_id=first, last_step_id=first + steps - 1, steps=steps)
    for _ in range(steps):
        r.step_compute_s.append(compute_s)
        r.step_wait_s.append(0.0)
        r.step_tokens.append(tokens)
    r.compute_s = compute_s * steps
    r.busy_wall_s = r.compute_s
    r.tokens = tokens * steps
    r.layers = layers
    return r


def varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def padded(r: afd_pb2.StepTimings, nbytes: int) -> afd_pb2.StepTimings:
    """`r` with an unknown field (number 99) of `nbytes` bytes, as an attacker sends it."""
    unknown = varint(99 << 3 | 2) + varint(nbytes) + b"x" * nbytes
    return afd_pb2.StepTimings.FromString(r.SerializeToString() + unknown)


def controller(model: ModelFingerprint | None = None):
    """A 1:1 controller with both workers registered (call inside an event loop)."""
    c = Controller(DaemonConfig(), first_epoch=100)
    a = c.open_session(WorkerSpec("a0", ATTENTION, model=model), "p")
    f = c.open_session(WorkerSpec("f0", FFN, model=model), "p")
    return c, a, f


def publish(c: Controller, a, step_id: int, **flags: bool) -> None:
    payload = make_payload(step_id, 1, 1)
    payload.is_warmup = False
    for name, value in flags.items():
        setattr(payload, name, value)
    payload.epoch = c.membership.epoch
    c.publish(a, payload)


def test_reports_keep_known_fields_only_and_impossible_values_are_refused_with_the_reason():
    async def scenario():
        c, a, f = controller(ModelFingerprint(num_layers=4))
        publish(c, a, 1)  # the largest step relayed to the group: make_payload's tokens
        most = c.timing._relayed[0].max_step_tokens
        now = 1000.0

        def take(r, who=a) -> tuple[bool, str]:
            nonlocal now
            now += 1.0  # under the rate bound
            ok = c.timing.record(who.worker, r, now=now)
            return ok, c.timing.step_windows.windows[who.worker.worker_id].last_refusal

        good = report(10, 5, tokens=most, layers=4)
        big = padded(good, 1 << 20)
        assert big.ByteSize() > 1 << 20
        assert take(big) == (True, "")
        (kept,) = c.timing.step_windows.windows["a0"].reports
        assert kept.ByteSize() == known_fields(good).ByteSize() < MAX_REPORT_BYTES
        assert c.timing.timings().ByteSize() < 16 << 10

        cases = {
            "compute_s is NaN": lambda r: setattr(r, "compute_s", math.nan),
            "busy_wall_s is infinite": lambda r: setattr(r, "busy_wall_s", math.inf),
            "wait_s is negative": lambda r: setattr(r, "wait_s", -1.0),
            "step_compute_s[2] is NaN": lambda r: r.step_compute_s.__setitem__(2, math.nan),
            "exceeds busy_wall_s": lambda r: setattr(r, "compute_s", 80357143.0 * r.busy_wall_s),
            "layers 7 is not the registered model's 4": lambda r: setattr(r, "layers", 7),
            f"above the largest step relayed to its group ({most})": lambda r: (
                r.step_tokens.__setitem__(0, most + 1)
            ),
            "last_step_id 18446744073709551605 is above 2^62": lambda r: setattr(
                r, "last_step_id", UINT64_MAX - 10
            ),
            "5 per-step entries for 6 steps": lambda r: setattr(r, "steps", 6),
        }
        for why, mutate in cases.items():
            bad = afd_pb2.StepTimings()
            bad.CopyFrom(good)
            mutate(bad)
            ok, refusal = take(bad)
            assert not ok and why in refusal, (why, refusal)
        load = c.timing.loads()[0]
        assert load.reports == 1 and load.reports_dropped == len(cases)
        assert math.isfinite(load.utilisation) and load.utilisation <= 1.0
        assert "per-step entries" in load.last_refusal  # the last reason, for status --json

    asyncio.run(scenario())


def test_windows_are_bounded_in_bytes_per_worker_and_in_total():
    windows = StepWindows(window_reports=64, max_total_bytes=200 << 10)
    full = report(1, 256)
    for worker in range(8):
        for i in range(100):
            assert windows.record(f"w{worker}", "FFN", worker, full, now=10.0 * i)
    sizes = {w: window.nbytes for w, window in windows.windows.items()}
    assert windows.nbytes == sum(sizes.values()) <= 200 << 10
    assert all(len(w.reports) >= 1 for w in windows.windows.values())
    assert max(sizes.values()) - min(sizes.values()) <= 2 * full.ByteSize()  # evenly shared
    windows.forget("w0")
    assert windows.nbytes == sum(w.nbytes for w in windows.windows.values())


def test_warmup_steps_are_counted_apart_flagged_or_relayed_as_warmup():
    async def scenario():
        c, a, f = controller()
        for step in (1, 2, 3):
            publish(c, a, step, is_warmup=True)
        publish(c, a, 4, is_profile=False)
        # The FFN worker does not flag warm-up: its report over steps 1..4 overlaps the
        # relayed warm-up steps and is kept out of its window.
        assert c.timing.record(f.worker, report(1, 4, compute_s=13.3), now=1.0)
        assert c.timing.record(f.worker, report(5, 6), now=2.0)
        # The attention worker flags its own (StepTimings.warmup).
        flagged = report(5, 3)
        flagged.warmup = True
        assert c.timing.record(a.worker, flagged, now=1.0)
        assert c.timing.record(a.worker, report(8, 2), now=2.0)
        loads = {x.worker_id: x for x in c.timing.loads()}
        assert (loads["f0"].steps, loads["f0"].warmup_steps) == (6, 4)
        assert loads["f0"].warmup_compute_s == pytest.approx(4 * 13.3)
        assert loads["f0"].compute_ms_per_step == pytest.approx(1.0)
        assert (loads["a0"].steps, loads["a0"].warmup_steps) == (2, 3)
        # A new session of the sender counts from 1 again: the old ranges no longer apply.
        c.close_session(a, "restart")
        a2 = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        publish(c, a2, 1)
        assert c.timing.record(f.worker, report(1, 2), now=3.0)
        assert {x.worker_id: x.steps for x in c.timing.loads()} == {"f0": 8}

    asyncio.run(scenario())


def test_step_ids_near_the_limit_cannot_overflow_a_trace_and_a_leaver_completes_it():
    async def scenario():
        c, a, f = controller()
        assert c.timing.record(f.worker, report(1, 2), now=1.0)
        assert not c.timing.record(a.worker, report(UINT64_MAX - 5, 1), now=1.0)
        assert c.timing.record(a.worker, report(3, 2), now=2.0)
        trace = c.start_trace(10)
        assert trace.first_step_id < 100
        # A worker that leaves before answering ends its part of the trace at once.
        c.close_session(f, "gone")
        assert not trace.complete
        spans = afd_pb2.TraceSpans(trace_id=trace.trace_id, worker_received_s=1, worker_sent_s=2)
        c.record_trace(a, spans, 3.0)
        assert trace.complete
        result = trace.result()
        assert list(result.missing) == ["f0"]
        assert "f0: its session ended before it answered" in result.problems
        c.timing.end_trace(trace)
        assert c.timing.trace is None

    asyncio.run(scenario())


def test_spans_with_broken_clocks_are_left_out_and_the_file_stays_valid():
    asked = {
        w: afd_pb2.WorkerInfo(worker_id=w, role=afd_pb2.FFN, role_rank=i)
        for i, w in enumerate(("good", "far", "nan"))
    }
    trace = PendingTrace(3, 10, 2, 50.0, asked)
    good = afd_pb2.TraceSpans(trace_id=3, worker_received_s=1.0, worker_sent_s=1.5)
    good.spans.add(name="step", step_id=10, start_s=1.1, end_s=1.2, layer=-1)
    assert trace.take("good", good, 50.6)
    far = afd_pb2.TraceSpans(trace_id=3, worker_received_s=1.0, worker_sent_s=1.5)
    far.spans.add(name="step", step_id=10, start_s=1e15, end_s=1e15 + 1, layer=-1)
    far.spans.add(name="step", step_id=11, start_s=math.nan, end_s=1.3, layer=-1)
    far.spans.add(name="x" * 1000, step_id=11, start_s=1.2, end_s=1.3, layer=-1)
    far.spans.add(name="step", step_id=11, start_s=1.3, end_s=1.25, layer=-1)
    far.spans.add(name="step", step_id=11, start_s=1.2, end_s=1.3, layer=-1)  # kept
    assert trace.take("far", far, 50.6)
    nan = afd_pb2.TraceSpans(trace_id=3, worker_received_s=math.nan, worker_sent_s=1.5)
    nan.spans.add(name="step", step_id=10, start_s=1.1, end_s=1.2, layer=-1)
    assert not trace.take("nan", nan, 50.6)
    assert trace.complete
    result = trace.result()
    assert [len(w.spans) for w in result.workers] == [1, 1]
    assert list(result.missing) == ["nan"]
    problems = "\n".join(result.problems)
    assert "far: 4 span(s) left out, the first: step of step 10 lies" in problems
    assert "nan: clock readings" in problems
    doc = to_chrome(result)
    assert check_trace_events(doc) == []
    assert max(e.get("ts", 0) for e in doc["traceEvents"]) < 1e6  # one worker shifts nobody
    json.dumps(doc, allow_nan=False)


def test_padded_reports_and_huge_step_ids_through_a_real_daemon(start_daemon) -> None:
    """The attack of issue 39 with the real worker client: 24 reports padded to 3 MB each (72
    MB as stored before) leave GetTimings small and working, with no traceback in the log; a
    report and a payload with step ids at the 64-bit limit are refused, and `afd-ctl trace`
    fails cleanly and can be run again (it used to fail UNKNOWN, then say "a trace is already
    being recorded" until the daemon restarted)."""
    daemon = start_daemon()
    attention = ControllerClient(daemon.address, WorkerSpec("a0", ATTENTION))
    ffn = ControllerClient(daemon.address, WorkerSpec("f0", FFN))
    try:
        for client in (attention, ffn):
            client.connect(10)
        attention.wait_complete(10)
        for i in range(24):
            request = afd_pb2.SessionRequest(timings=padded(report(1 + 10 * i, 10), 3 << 20))
            assert request.ByteSize() > 3 << 20
            assert attention._link.send(request)
            time.sleep(0.06)  # under the rate bound: every one is taken
        evil = report(UINT64_MAX - 20, 10)
        assert ffn._link.send(afd_pb2.SessionRequest(timings=evil))
        payload = make_payload(5, 1, 1)
        payload.step_id = UINT64_MAX
        attention.publish(payload)
        with pytest.raises(Exception, match="STEP_ID|above 2\\^62"):
            attention.flush(10)
        with grpc.insecure_channel(daemon.address) as channel:
            stub = afd_pb2_grpc.AFDInspectStub(channel)
            deadline = time.monotonic() + 20
            while True:
                timings = stub.GetTimings(afd_pb2.GetTimingsRequest(), timeout=10)
                loads = {w.load.worker_id: w.load for w in timings.workers}
                if (
                    "a0" in loads
                    and loads["a0"].reports == 24
                    and "f0" in loads
                    and loads["f0"].reports_dropped == 1
                ):
                    break
                assert time.monotonic() < deadline, timings.workers
                time.sleep(0.2)
            assert timings.ByteSize() < 1 << 20
            assert "step_id 18446744073709551595 is above 2^62" in loads["f0"].last_refusal
            status = stub.GetStatus(afd_pb2.GetStatusRequest(), timeout=10)
            assert status.last_step_id < 1 << 62
        for _ in range(2):
            out = afd_ctl(
                daemon.address, "trace", "--steps", "3", "--out", "/dev/null", "--wait-s", "2"
            )
            assert out.returncode == 1, out
            assert "already being recorded" not in out.stderr and "UNKNOWN" not in out.stderr
            assert out.stderr.count("\n") == 1, out.stderr
        log = daemon.log()
        assert "Traceback" not in log, log[-3000:]
        assert "step timings from 'f0' refused" in log
    finally:
        for client in (attention, ffn):
            client.close()


def test_a_trace_starts_half_a_second_of_steps_ahead_of_each_workers_pace():
    """The CI run of 2026-12-02: a trace asked of workers reporting every 0.1 s started 15
    steps ahead, the loaded host handed the FFN the request after those steps, and the FFN
    sent no spans. The lead now covers 0.5 s at each worker's pace; an empty answer is named."""

    async def scenario():
        c, a, f = controller()
        # f: 100 steps a report, 10 reports a second (1,000 steps a second).
        for i in range(3):
            assert c.timing.record(f.worker, report(1 + 100 * i, 100), now=1.0 + 0.1 * i)
        trace = c.start_trace(4)
        # After its last step (300): one report's lag (100) and 0.5 s at its pace (500).
        assert 300 + 100 + 500 <= trace.first_step_id <= 300 + 100 + 500 + 3
        spans = afd_pb2.TraceSpans(trace_id=trace.trace_id, worker_received_s=1, worker_sent_s=2)
        c.record_trace(f, spans, 3.0)
        assert any("f0: sent no spans of steps" in p for p in trace.result().problems)
        c.timing.end_trace(trace)

    asyncio.run(scenario())
