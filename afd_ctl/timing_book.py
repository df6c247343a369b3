"""The daemon's timing book (issue 26): every reporting worker's rolling window of step
timings and the trace being recorded, which `afd-ctl status` (LOAD), `advise`, `trace` and
`/metrics` read. Plain Python, no gRPC: the controller hands it what workers send.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from afd_ctl.errors import ControlError
from afd_ctl.membership import Worker
from afd_ctl.step_window import Histogram, StepWindows, load_of
from afd_ctl.trace import MAX_TRACE_STEPS, PendingTrace
from afd_ctl.v1 import afd_pb2
from afd_ctl.wire import ROLE_TO_PROTO

log = logging.getLogger(__name__)


class TimingBook:
    def __init__(self) -> None:
        self.step_windows = StepWindows()
        self.trace: PendingTrace | None = None
        self._trace_ids = 0

    # -- reports -------------------------------------------------------------------------
    def record(self, worker: Worker, report: afd_pb2.StepTimings) -> bool:
        """A worker's StepTimings; False when refused (too fast, too large; counted)."""
        return self.step_windows.record(worker.worker_id, worker.role, worker.role_rank, report)

    def forget(self, worker_id: str) -> None:
        self.step_windows.forget(worker_id)

    def reporting(self, worker_id: str) -> bool:
        return worker_id in self.step_windows.windows

    # -- traces --------------------------------------------------------------------------
    def start_trace(
        self, steps: int, asked: Mapping[str, afd_pb2.WorkerInfo], last_step_id: int
    ) -> tuple[PendingTrace, afd_pb2.TraceStart]:
        """Records the trace of the next `steps` steps on the `asked` workers, from a step id
        far enough ahead that all of them see it whole; the TraceStart to send them."""
        if not 1 <= steps <= MAX_TRACE_STEPS:
            raise ControlError("INVALID_ARGUMENT", f"steps {steps} is not in 1..{MAX_TRACE_STEPS}")
        if self.trace is not None and not self.trace.complete:
            raise ControlError("FAILED_PRECONDITION", "a trace is already being recorded")
        self._trace_ids += 1
        # Ahead of every worker: two steps past the last relayed payload (the next one may be on
        # its way), and past each worker's last report by as many steps again as that report
        # held (reports lag by up to one interval; steps that no payload names, too).
        first = last_step_id + 2
        for worker_id in asked:
            reports = self.step_windows.windows[worker_id].reports
            if reports:
                first = max(first, reports[-1].last_step_id + reports[-1].steps + 2)
        sent_at = time.monotonic()
        self.trace = PendingTrace(self._trace_ids, first, steps, sent_at, dict(asked))
        start = afd_pb2.TraceStart(
            trace_id=self._trace_ids, first_step_id=first, steps=steps, daemon_sent_s=sent_at
        )
        log.info(
            "trace %d: steps %d..%d on %d worker(s)",
            self._trace_ids,
            first,
            first + steps - 1,
            len(asked),
        )
        return self.trace, start

    def take_spans(self, worker_id: str, spans: afd_pb2.TraceSpans, received_at: float) -> None:
        if self.trace is not None:
            self.trace.take(worker_id, spans, received_at)

    def end_trace(self, trace: PendingTrace) -> None:
        if self.trace is trace:
            self.trace = None

    # -- views ---------------------------------------------------------------------------
    def loads(self) -> list[afd_pb2.WorkerLoad]:
        return [
            load_of(window, ROLE_TO_PROTO[window.role])
            for _, window in sorted(self.step_windows.windows.items())
        ]

    def timings(self) -> afd_pb2.Timings:
        out = afd_pb2.Timings(window_reports=self.step_windows.window_reports)
        for load in self.loads():
            window = self.step_windows.windows[load.worker_id]
            out.workers.add(load=load, window=list(window.reports))
        return out

    def histograms(self) -> dict[str, tuple[str, dict[str, Histogram]]]:
        """Per worker id, its role and a copy of its per-phase histograms (for a scrape)."""
        return {
            worker_id: (
                w.role,
                {k: dataclasses.replace(h, counts=list(h.counts)) for k, h in w.histograms.items()},
            )
            for worker_id, w in self.step_windows.windows.items()
        }
