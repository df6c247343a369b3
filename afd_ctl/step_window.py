"""Each worker's rolling window of per-step timing reports (issue 26), free of gRPC.

Workers send `StepTimings` aggregates about once a second on their Session. The daemon keeps
the last `window_reports` serving reports per worker, bounded in bytes per worker and in total
(issue 39: a window never makes `GetTimings` exceed gRPC's message limit), refuses reports
that come too fast or say what cannot be (afd_ctl/report_checks.py; counted, with the last
reason, never an error: reporting is optional), counts warm-up steps apart, and derives each
worker's load from the window: utilisation (compute over busy wall time) and its share of
waiting.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from afd_ctl.report_checks import MAX_REPORT_BYTES, checked_report
from afd_ctl.v1 import afd_pb2

WINDOW_REPORTS = 64
# A worker's pace is measured over at least this long between reports.
MIN_PACE_INTERVAL_S = 0.05
# At most this many reports a second per worker, in bursts of at most REPORT_BURST (reports
# sent a second apart can arrive together); more are dropped.
MAX_REPORTS_PER_S = 20.0
REPORT_BURST = 10.0
# What all windows together may hold; over it, the largest window gives up its oldest reports.
# Far below the 64 MiB gRPC message limit of GetTimings, which returns every window.
MAX_TOTAL_BYTES = 32 << 20
MAX_WORKER_BYTES = WINDOW_REPORTS * MAX_REPORT_BYTES
# Histogram bucket bounds (seconds) for per-step compute and wait times.
BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
PHASES = ("compute", "wait")


@dataclass
class Histogram:
    """Cumulative Prometheus-style buckets: counts[i] observations <= BUCKETS_S[i]."""

    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_S))
    total: int = 0
    sum_s: float = 0.0

    def observe(self, value_s: float) -> None:
        self.total += 1
        self.sum_s += value_s
        for i, bound in enumerate(BUCKETS_S):
            if value_s <= bound:
                self.counts[i] += 1


@dataclass
class WorkerWindow:
    worker_id: str
    role: str
    role_rank: int
    reports: deque[afd_pb2.StepTimings] = field(
        default_factory=lambda: deque(maxlen=WINDOW_REPORTS)
    )
    dropped: int = 0
    last_refusal: str = ""
    # Warm-up, profile and capture steps, kept out of the window.
    warmup_steps: int = 0
    warmup_compute_s: float = 0.0
    exchange_path: str = ""  # of its latest report
    nbytes: int = 0
    # Its pace: steps a second between its last two reports (what a trace's lead is set from),
    # and when its latest report came and the step it ended at.
    steps_per_s: float = 0.0
    seen_at: float = 0.0
    seen_step: int = 0
    # Token bucket of the rate bound: reports it may take now, and when it was last filled.
    allowance: float = REPORT_BURST
    filled_at: float = 0.0
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {phase: Histogram() for phase in PHASES}
    )


def load_of(window: WorkerWindow, role_proto: afd_pb2.Role) -> afd_pb2.WorkerLoad:
    reports = list(window.reports)
    steps = sum(r.steps for r in reports)
    wall = sum(r.busy_wall_s for r in reports)
    compute = sum(r.compute_s for r in reports)
    wait = sum(r.wait_s for r in reports)
    send = sum(r.send_s for r in reports)
    per_step = 1.0 / steps if steps else 0.0
    return afd_pb2.WorkerLoad(
        worker_id=window.worker_id,
        role=role_proto,
        role_rank=window.role_rank,
        steps=steps,
        reports=len(reports),
        utilisation=compute / wall if wall > 0 else 0.0,
        waiting_share=wait / wall if wall > 0 else 0.0,
        compute_ms_per_step=1e3 * compute * per_step,
        wait_ms_per_step=1e3 * wait * per_step,
        send_ms_per_step=1e3 * send * per_step,
        tokens_per_step=sum(r.tokens for r in reports) * per_step,
        bytes_per_step=sum(r.bytes for r in reports) * per_step,
        layers=reports[-1].layers if reports else 0,
        reports_dropped=window.dropped,
        warmup_steps=window.warmup_steps,
        warmup_compute_s=window.warmup_compute_s,
        last_refusal=window.last_refusal,
        exchange_path=window.exchange_path,
    )


class StepWindows:
    """Per-worker windows keyed by worker id; a worker's window goes when its session ends."""

    def __init__(
        self, window_reports: int = WINDOW_REPORTS, max_total_bytes: int = MAX_TOTAL_BYTES
    ) -> None:
        self.window_reports = window_reports
        self.max_total_bytes = max_total_bytes
        self.windows: dict[str, WorkerWindow] = {}
        self.nbytes = 0

    def window(self, worker_id: str, role: str, role_rank: int) -> WorkerWindow:
        window = self.windows.get(worker_id)
        if window is None or window.role != role or window.role_rank != role_rank:
            self.forget(worker_id)
            window = WorkerWindow(worker_id, role, role_rank, deque(maxlen=self.window_reports))
            self.windows[worker_id] = window
        return window

    def admit(self, window: WorkerWindow, now: float | None = None) -> bool:
        """The rate bound: whether one more report of `window`'s worker may be taken now."""
        now = time.monotonic() if now is None else now
        if window.filled_at:
            refill = (now - window.filled_at) * MAX_REPORTS_PER_S
            window.allowance = min(REPORT_BURST, window.allowance + refill)
        window.filled_at = now
        if window.allowance < 1.0:
            self.refuse(window, f"more than {MAX_REPORTS_PER_S:g} reports a second")
            return False
        window.allowance -= 1.0
        return True

    def refuse(self, window: WorkerWindow, why: str) -> None:
        window.dropped += 1
        window.last_refusal = why

    def add(
        self, window: WorkerWindow, report: afd_pb2.StepTimings, now: float | None = None
    ) -> None:
        """Takes a checked report: warm-up steps are counted apart, the rest kept."""
        now = time.monotonic() if now is None else now
        if window.seen_at and report.last_step_id > window.seen_step:
            # (two reports that arrive together do not make a pace of thousands a second)
            elapsed = max(now - window.seen_at, MIN_PACE_INTERVAL_S)
            window.steps_per_s = (report.last_step_id - window.seen_step) / elapsed
        window.seen_at, window.seen_step = now, max(window.seen_step, report.last_step_id)
        window.exchange_path = report.exchange_path or window.exchange_path
        if report.warmup:
            window.warmup_steps += report.steps
            window.warmup_compute_s += report.compute_s
            return
        size = report.ByteSize()
        if len(window.reports) == window.reports.maxlen:
            self._drop_oldest(window)
        window.reports.append(report)
        window.nbytes += size
        self.nbytes += size
        for phase, values in (("compute", report.step_compute_s), ("wait", report.step_wait_s)):
            for value in values:
                window.histograms[phase].observe(value)
        while window.nbytes > MAX_WORKER_BYTES:
            self._drop_oldest(window)
        while self.nbytes > self.max_total_bytes:
            self._drop_oldest(max(self.windows.values(), key=lambda w: w.nbytes))

    def _drop_oldest(self, window: WorkerWindow) -> None:
        size = window.reports.popleft().ByteSize()
        window.nbytes -= size
        self.nbytes -= size

    def record(
        self,
        worker_id: str,
        role: str,
        role_rank: int,
        report: afd_pb2.StepTimings,
        now: float | None = None,
    ) -> bool:
        """Takes one report (checked with nothing known of the worker); False (and counted)
        when it is refused."""
        window = self.window(worker_id, role, role_rank)
        if not self.admit(window, now):
            return False
        clean, why = checked_report(report)
        if clean is None:
            self.refuse(window, why)
            return False
        self.add(window, clean, now)
        return True

    def forget(self, worker_id: str) -> None:
        window = self.windows.pop(worker_id, None)
        if window is not None:
            self.nbytes -= window.nbytes
