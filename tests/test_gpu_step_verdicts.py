"""The GPU-driven step without a host wait (vllm_ext.exchange.gpu_watchdog,
vllm_ext.attention.verdicts), driven by a simulated GPU stream (tests/gpu_stream_sim.py: the
operation lists of afd_data.gpu_protocol on threads that progress by themselves).

What a user would notice: a step closes at once (the host goes on to the next one while the
GPU runs it); a step that ran to its end gives its tokens; a step in flight when the FFN side
dies (or that overruns its bound) is released, fails with the reason, and so does every step
enqueued after it until a reconnect; none of their verdicts passes. And the GPU-driven path
reports step timings to afd-ctl: `afd-ctl status` shows the path and `afd-ctl trace` a trace.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from afd_ctl.errors import AfdPeerLost, AfdTimeout
from tests.gpu_stream_sim import SimGpu
from tests.procs import child_env
from vllm_ext.attention.step_failures import AfdStepFailed, failing_step
from vllm_ext.attention.verdicts import Verdicts
from vllm_ext.exchange import gpu_watchdog
from vllm_ext.exchange.gpu_watchdog import InFlight, StepWatchdog

LAYERS = 4
FFN_COMPUTE_S = 0.002  # per layer: a step takes about 8 ms on the simulated GPU


def wait_until(condition: Callable[[], bool], bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class Side:
    """The attention side's host over a simulated GPU: what GpuAttentionExchange does per step
    (an event at open, the step's operations, an end event handed to the watchdog)."""

    def __init__(self, bound_s: float = 5.0) -> None:
        self.gpu = SimGpu(LAYERS, FFN_COMPUTE_S)
        self.lost: str | None = None
        self.marked: list[str] = []
        self.watchdog = StepWatchdog(
            poison=self.gpu.poison, lost=lambda: self.lost, mark_lost=self.marked.append
        )
        self.watchdog.start()
        self.bound_s = bound_s

    def step(self, step_id: int, ffn: bool = True) -> float:
        """Enqueues one step on both streams; returns the host's time to close it."""
        t0 = time.perf_counter()
        start = self.gpu.event(self.gpu.attention)
        self.gpu.attention_step()
        if ffn:
            self.gpu.ffn_step()
        end = self.gpu.event(self.gpu.attention)
        now = time.monotonic()
        self.watchdog.enqueue(InFlight(step_id, start, end, self.bound_s, now, 0.0, 2, 0))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.watchdog.stop()
        self.gpu.stop()


@pytest.fixture
def side():
    made: list[Side] = []

    def make(**kwargs: float) -> Side:
        made.append(Side(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_steps_close_at_once_and_settle_when_their_tokens_are_read(side) -> None:
    s = side()
    closes = [s.step(i) for i in range(1, 21)]
    # The host closes a step without waiting for its GPU time (~8 ms): a typical close takes
    # well under half of it, and the 20 closes together less than half of the 20 steps' GPU
    # time (a host that waited would need all of it). Not the slowest single close: on a
    # loaded 2-core CI machine one can lose the CPU for several milliseconds.
    step_gpu_s = LAYERS * FFN_COMPUTE_S
    assert statistics.median(closes) < step_gpu_s / 2, closes
    assert sum(closes) < 20 * step_gpu_s / 2, closes
    s.watchdog.verdict(range(1, 21), s.bound_s)  # all ran to their end: no raise
    retired = s.watchdog.take_retired()
    assert [r.step_id for r in retired] == list(range(1, 21))
    assert all(r.gpu_s >= LAYERS * FFN_COMPUTE_S * 0.9 for r in retired)
    assert s.gpu.poisoned == 0 and not s.marked


def test_a_lost_ffn_fails_the_steps_in_flight_and_later_ones_until_a_reset(
    side, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The overrun round far off: the loss must be seen because it wakes the watchdog.
    monkeypatch.setattr(gpu_watchdog, "WATCH_S", 60.0)
    s = side()
    s.step(1)
    s.watchdog.verdict([1], s.bound_s)
    s.gpu.kill_ffn()  # kill -9 of the FFN server: its stream runs no more
    s.step(2, ffn=False)
    s.step(3, ffn=False)
    time.sleep(0.02)  # the attention stream is parked on step 2's first wait
    assert not s.gpu.drained()
    assert wait_until(lambda: s.watchdog.thread_rounds > 0, 2.0)  # now in its 60 s wait
    s.lost = "ffn rank 0 was reported lost by the control plane"
    s.watchdog.wake()  # as the data plane's loss record does (afd_data.loss.Loss.listeners)
    woken = time.monotonic()
    with pytest.raises(AfdPeerLost, match="reported lost"):
        s.watchdog.verdict([2], s.bound_s)
    assert time.monotonic() - woken < 10.0  # seen at once, not at the next round (60 s)
    with pytest.raises(AfdPeerLost):
        s.watchdog.verdict([3], s.bound_s)
    assert wait_until(s.gpu.drained, 2.0) and s.gpu.poisoned > 0  # released, not hanging
    assert s.marked and "reported lost" in s.marked[0]  # the data plane knows
    # The host's next step fails at once with it (told once: the one after waits for a view).
    assert "reported lost" in (s.watchdog.take_failure() or "")
    assert s.watchdog.take_failure() is None
    s.step(4, ffn=False)  # enqueued before the host saw the loss: it consumes poison too
    with pytest.raises(AfdPeerLost):
        s.watchdog.verdict([4], s.bound_s)
    # A reconnect: drained, flags zeroed, the FFN side back; steps run again.
    s.watchdog.drain("reconnecting", 1.0)
    s.watchdog.reset()
    s.lost = None
    s.gpu.flags.clear()
    s.gpu.ffn.dead = False
    s.gpu.ffn.queue.clear()
    s.step(5)
    s.watchdog.verdict([5], s.bound_s)


def test_a_step_past_its_bound_fails_with_a_timeout(side) -> None:
    s = side(bound_s=0.2)
    s.gpu.kill_ffn()  # stalled, and nobody reports a loss
    s.step(1, ffn=False)
    t0 = time.monotonic()
    with pytest.raises(AfdTimeout, match="did not finish within 0.2 s"):
        s.watchdog.verdict([1], s.bound_s)
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert s.marked  # the transport is marked lost: the next step reconnects or fails


def test_a_failed_verdict_fails_the_step_and_is_asked_once(side) -> None:
    """Verdicts as the attention worker hands them to vLLM: the check of the steps closed since
    the last sampling raises AfdStepFailed (vLLM fails their requests: no token goes out)."""
    s = side()

    class Exchange:
        def settle(self, ids: list[int]) -> None:
            s.watchdog.verdict(ids, s.bound_s)

    failures: list[BaseException] = []
    verdicts = Verdicts(lambda step_id: failing_step(step_id, on_failure=failures.append))
    exchange = Exchange()
    s.step(1)
    verdicts.closed(exchange, 1)  # type: ignore[arg-type]
    verdicts.take()()  # step 1's tokens are good
    s.gpu.kill_ffn()
    s.lost = "ffn rank 0 left"
    s.step(2, ffn=False)
    verdicts.closed(exchange, 2)  # type: ignore[arg-type]
    check = verdicts.take()  # taken at sampling; run where the tokens are read
    with pytest.raises(AfdStepFailed, match="step 2: afd peer lost: ffn rank 0 left"):
        check()
    assert len(failures) == 1
    verdicts.take()()  # nothing left to ask


def test_gpu_path_reports_reach_status_and_trace(start_daemon, side, tmp_path: Path) -> None:
    """A GPU-driven worker's step timings (its watchdog's retired steps, no host wait) reach
    afd-ctl: `status` shows the path and the timings, `trace` records its steps."""
    from afd_ctl.client import ControllerClient, WorkerSpec
    from afd_ctl.trace import check_trace_events
    from afd_data.gpu_protocol import GPU
    from vllm_ext.exchange.timing import ExchangeTimings

    daemon = start_daemon()
    s = side()
    attn = ControllerClient(daemon.address, WorkerSpec("attn-0", "ATTENTION"), data_plane_blob=b"")
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", "FFN"), data_plane_blob=b"")
    timings: list[ExchangeTimings] = []
    for client in (attn, ffn):
        client.timings.interval_s = 0.1
        client.timings.layers = LAYERS
        t = ExchangeTimings(client.timings)
        t.set_path(GPU)
        timings.append(t)
    stop = threading.Event()
    try:
        attn.connect(10)
        ffn.connect(10)
        tracer: subprocess.Popen[str] | None = None
        for step_id in range(1, 201):
            opened = time.monotonic()
            s.step(step_id)
            timings[0].host_span(step_id, opened, time.monotonic())
            for retired in s.watchdog.take_retired():
                for t in timings:  # the FFN's step graph spans the same GPU time here
                    t.gpu_step(retired)
            if step_id == 60:
                tracer = subprocess.Popen(
                    [sys.executable, "-m", "afd_ctl.cli", "trace", "--controller",
                     daemon.address, "--steps", "4", "--out", str(tmp_path / "trace.json")],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                )  # fmt: skip
            s.watchdog.verdict([step_id], s.bound_s)  # vLLM reads the tokens
        for client in (attn, ffn):
            client.timings.flush()
        assert tracer is not None
        _, err = tracer.communicate(timeout=60)
        assert tracer.returncode == 0, err
        doc = json.loads((tmp_path / "trace.json").read_text())
        assert check_trace_events(doc) == []
        names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
        assert {"step", "gpu"} <= names
        status = subprocess.run(
            [sys.executable, "-m", "afd_ctl.cli", "status", "--json", "--controller",
             daemon.address],
            capture_output=True, text=True, timeout=30, env=child_env(),
        )  # fmt: skip
        loads = {x["worker_id"]: x for x in json.loads(status.stdout)["loads"]}
        for worker in ("attn-0", "ffn-0"):
            assert loads[worker]["exchange_path"] == GPU
            assert float(loads[worker]["compute_ms_per_step"]) >= 1e3 * LAYERS * FFN_COMPUTE_S * 0.9
        text = subprocess.run(
            [sys.executable, "-m", "afd_ctl.cli", "status", "--controller", daemon.address],
            capture_output=True, text=True, timeout=30, env=child_env(),
        ).stdout  # fmt: skip
        assert any(line.startswith("attn-0") and " gpu " in line for line in text.splitlines())
    finally:
        stop.set()
        for client in (attn, ffn):
            client.close()


def test_a_retired_steps_events_are_recorded_again_for_a_new_step() -> None:
    """The GPU-driven exchange takes its steps' timing events from a pool: a step's two events
    go back once it ran to its end and was reported, and the next step records them again on
    the current stream instead of creating CUDA events (at most `keep` kept)."""
    from vllm_ext.exchange import gpu_events

    class Driver:  # afd_data.cuda_driver's event calls, without a GPU
        def __init__(self) -> None:
            self.created = 0
            self.records: dict[int, list[int]] = {}

        def event_create(self) -> int:
            self.created += 1
            self.records[self.created] = []
            return self.created

        def event_record(self, event: int, stream: int) -> None:
            self.records[event].append(stream)

        def event_destroy(self, event: int) -> None:
            self.records.pop(event)

    cuda = Driver()
    pool = gpu_events.EventPool(cuda, stream=lambda: 7, keep=2)
    first = [pool.recorded(), pool.recorded(), pool.recorded()]
    assert cuda.created == 3
    pool.give_back(*first, None)  # a capture step has no start event
    again = [pool.recorded(), pool.recorded(), pool.recorded()]
    assert cuda.created == 4  # two reused (keep=2), one new
    assert sorted(len(cuda.records[e.handle]) for e in again) == [1, 2, 2]
    assert {s for e in again for s in cuda.records[e.handle]} == {7}  # the current stream
    del first, again
    assert cuda.records == {}  # every event destroyed once dropped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="driver events need a CUDA GPU")
def test_driver_timing_events_time_work_on_the_current_stream() -> None:
    """The GPU-driven steps' events (vllm_ext.exchange.gpu_events, through the CUDA driver) on
    torch's current stream: done only once the work before the end event ran, their elapsed
    time that work's, and the timeline's clock places them on the host's clock."""
    from afd_data.cuda_driver import driver
    from vllm_ext.exchange import gpu_events
    from vllm_ext.exchange.timeline import GpuClock

    device = torch.device("cuda", torch.cuda.current_device())
    pool = gpu_events.EventPool(driver(), gpu_events.current_stream_of(device))
    x = torch.randn(4096, 4096, device=device)
    before = time.monotonic()
    start = pool.recorded()
    for _ in range(20):
        x = x @ x / 64
    end = pool.recorded()
    assert start.query() or not end.query()  # an end before its start never passes first
    torch.cuda.current_stream().synchronize()
    after = time.monotonic()
    assert start.query() and end.query()
    gpu_s = start.elapsed_s(end)
    assert 0 < gpu_s < after - before
    clock = GpuClock()
    at_start, at_end = clock.host_time(start), clock.host_time(end)
    assert at_start is not None and at_end is not None
    assert before - 0.01 < at_start < at_end < after + 0.01


class _KeptFailureExchange:
    """What the session asks of the GPU path's exchange between steps, over a real watchdog:
    the failure of steps in flight (GpuSide.raise_failure) and the drain of a reconnect."""

    def __init__(self, watchdog: StepWatchdog) -> None:
        self.watchdog = watchdog

    def raise_failure(self) -> None:
        why = self.watchdog.take_failure()
        if why is not None:
            raise gpu_watchdog.failure_error(why)

    def reconnect(self) -> None:  # the drain and reset of GpuSide.drain
        self.watchdog.drain("reconnecting", 1.0)
        self.watchdog.reset()


@pytest.mark.parametrize("newer_view", [False, True])
def test_a_kept_failure_fails_the_next_step_unless_the_ffn_side_is_back(
    side, newer_view: bool
) -> None:
    """A step in flight when the FFN server died leaves its failure with the watchdog. The
    next step fails with it at once while afd-ctl has no newer complete view; once it has (the
    FFN server is back and /health says 200), the step reconnects first and runs: the GPU
    check's kill -9 case failed the first request after recovery with the old loss (2026-12-07)."""
    from types import SimpleNamespace

    from vllm_ext.attention.session import AttentionSession

    s = side()
    s.gpu.kill_ffn()
    s.step(1, ffn=False)
    s.lost = "ffn rank 0 was reported lost by the control plane"
    s.watchdog.wake()
    with pytest.raises(AfdPeerLost):
        s.watchdog.verdict([1], s.bound_s)
    exchange = _KeptFailureExchange(s.watchdog)
    session = AttentionSession.__new__(AttentionSession)
    session.client = object()
    session._link = SimpleNamespace(exchange=exchange, newer_view_known=lambda: newer_view)
    reconnects: list[int] = []

    def ensure_connected() -> None:  # what a reconnect to the newer view does to the exchange
        if newer_view:
            exchange.reconnect()
            reconnects.append(1)

    session.ensure_connected = ensure_connected  # type: ignore[method-assign]
    if newer_view:
        assert session.exchange_for_step() is exchange and reconnects == [1]
    else:
        with pytest.raises(AfdPeerLost, match="reported lost"):
            session.exchange_for_step()
