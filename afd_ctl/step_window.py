"""Each worker's rolling window of per-step timing reports (issue 26), free of gRPC.

Workers send `StepTimings` aggregates about once a second on their Session. The daemon keeps
the last `window_reports` of them per worker, refuses reports that come too fast or too large
(counted, never an error: reporting is optional), and derives each worker's load from the
window: utilisation (compute over busy wall time) and its share of waiting.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from afd_ctl.v1 import afd_pb2

WINDOW_REPORTS = 64
# At most this many reports a second per worker, in bursts of at most REPORT_BURST (reports
# sent a second apart can arrive together); more are dropped.
MAX_REPORTS_PER_S = 20.0
REPORT_BURST = 10.0
MAX_STEP_ENTRIES = 256
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
    # Token bucket of the rate bound: reports it may take now, and when it was last filled.
    allowance: float = REPORT_BURST
    filled_at: float = 0.0
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {phase: Histogram() for phase in PHASES}
    )


def refusal(report: afd_pb2.StepTimings) -> str:
    """Why a report is not taken, or ""."""
    if report.steps == 0:
        return "no steps"
    if (
        max(len(report.step_compute_s), len(report.step_wait_s), len(report.step_tokens))
        > MAX_STEP_ENTRIES
    ):
        return f"more than {MAX_STEP_ENTRIES} per-step entries"
    figures = (report.busy_wall_s, report.compute_s, report.wait_s, report.send_s)
    if any(not (0.0 <= x < 1e7) for x in figures):  # NaN fails too
        return "a negative, huge or NaN time"
    return ""


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
        exchange_path=reports[-1].exchange_path if reports else "",
    )


class StepWindows:
    """Per-worker windows keyed by worker id; a worker's window goes when its session ends."""

    def __init__(self, window_reports: int = WINDOW_REPORTS) -> None:
        self.window_reports = window_reports
        self.windows: dict[str, WorkerWindow] = {}

    def record(
        self,
        worker_id: str,
        role: str,
        role_rank: int,
        report: afd_pb2.StepTimings,
        now: float | None = None,
    ) -> bool:
        """Takes one report; False (and counted) when it is refused."""
        now = time.monotonic() if now is None else now
        window = self.windows.get(worker_id)
        if window is None or window.role != role or window.role_rank != role_rank:
            window = WorkerWindow(worker_id, role, role_rank, deque(maxlen=self.window_reports))
            self.windows[worker_id] = window
        if window.filled_at:
            refill = (now - window.filled_at) * MAX_REPORTS_PER_S
            window.allowance = min(REPORT_BURST, window.allowance + refill)
        window.filled_at = now
        if refusal(report) or window.allowance < 1.0:
            window.dropped += 1
            return False
        window.allowance -= 1.0
        window.reports.append(report)
        for phase, values in (("compute", report.step_compute_s), ("wait", report.step_wait_s)):
            for value in values:
                window.histograms[phase].observe(value)
        return True

    def forget(self, worker_id: str) -> None:
        self.windows.pop(worker_id, None)
