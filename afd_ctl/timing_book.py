"""The daemon's timing book (issue 26): every reporting worker's rolling window of step
timings and the trace being recorded, which `afd-ctl status` (LOAD), `advise`, `trace` and
`/metrics` read. Plain Python, no gRPC: the controller hands it what workers send and the
payloads it relays.

From the payloads it learns, per FFN group, which step ids were warm-up, profile or capture
steps and the largest step relayed: a report that overlaps a warm-up step is counted apart
(so LOAD and `advise` see serving steps, also from workers that do not flag warm-up
themselves), and a report claiming more tokens in a step than any step relayed is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from afd_ctl.errors import ControlError
from afd_ctl.logs import RateLimitedLog, clip
from afd_ctl.membership import Worker
from afd_ctl.report_checks import Expected, checked_report
from afd_ctl.step_window import Histogram, StepWindows, load_of
from afd_ctl.trace import MAX_TRACE_STEPS, PendingTrace
from afd_ctl.v1 import afd_pb2
from afd_ctl.wire import ROLE_TO_PROTO

log = logging.getLogger(__name__)

# A trace starts this long ahead of every worker's pace (at most MAX_LEAD_STEPS steps ahead).
TRACE_LEAD_S = 0.5
MAX_LEAD_STEPS = 10_000
# Warm-up step ranges remembered per group (start-up has a few runs of them).
WARMUP_RANGES = 32
UINT64_MAX = (1 << 64) - 1


@dataclass
class GroupSteps:
    """What the daemon relayed to one FFN group from its sender's current session."""

    sender_session: int
    warmup: deque[list[int]] = field(default_factory=lambda: deque(maxlen=WARMUP_RANGES))
    # The most tokens of one relayed step (all stages and DP ranks), over every session.
    max_step_tokens: int = 0

    def overlaps_warmup(self, first: int, last: int) -> bool:
        lo, hi = min(first, last), max(first, last)
        return any(start <= hi and lo <= end for start, end in self.warmup)


def is_warmup(payload: afd_pb2.AFDControlPayload) -> bool:
    return payload.is_warmup or payload.is_profile or payload.is_graph_capturing


class TimingBook:
    def __init__(self, groups: int = 1) -> None:
        self.groups = max(1, groups)
        self.step_windows = StepWindows()
        self.trace: PendingTrace | None = None
        self._trace_ids = 0
        self._relayed: dict[int, GroupSteps] = {}
        self._refusals: dict[str, RateLimitedLog] = {}
        # When the last report arrived (daemon monotonic; 0: none yet).
        self.last_report_at = 0.0

    # -- what the daemon relays ----------------------------------------------------------
    def on_payload(self, sender: Worker, payload: afd_pb2.AFDControlPayload) -> None:
        group = sender.role_rank % self.groups
        steps = self._relayed.get(group)
        if steps is None or steps.sender_session != sender.session_id:
            # A new session counts its steps from 1 again: its warm-up ranges start afresh.
            old = steps.max_step_tokens if steps is not None else 0
            steps = self._relayed[group] = GroupSteps(sender.session_id, max_step_tokens=old)
        tokens = sum(sum(stage.num_tokens_across_dp) for stage in payload.stages.values())
        steps.max_step_tokens = max(steps.max_step_tokens, tokens)
        if is_warmup(payload):
            step_id = payload.step_id
            if steps.warmup and steps.warmup[-1][1] + 1 >= step_id >= steps.warmup[-1][0]:
                steps.warmup[-1][1] = max(steps.warmup[-1][1], step_id)
            else:
                steps.warmup.append([step_id, step_id])

    # -- reports -------------------------------------------------------------------------
    def record(self, worker: Worker, report: afd_pb2.StepTimings, now: float | None = None) -> bool:
        """A worker's StepTimings, checked against what the daemon knows of the worker; False
        when refused (counted, and the reason kept for `status --json` and logged)."""
        windows = self.step_windows
        window = windows.window(worker.worker_id, worker.role, worker.role_rank)
        self.last_report_at = time.monotonic() if now is None else now
        if not windows.admit(window, now):
            self._log_refusal(worker.worker_id, window.last_refusal)
            return False
        relayed = self._relayed.get(worker.role_rank % self.groups)
        model = worker.spec.model
        expected = Expected(
            layers=model.num_layers if model is not None else 0,
            max_step_tokens=relayed.max_step_tokens if relayed is not None else 0,
        )
        clean, why = checked_report(report, expected)
        if clean is None:
            windows.refuse(window, why)
            self._log_refusal(worker.worker_id, why)
            return False
        if relayed is not None and relayed.overlaps_warmup(clean.first_step_id, clean.last_step_id):
            clean.warmup = True
        windows.add(window, clean, now)
        return True

    def _log_refusal(self, worker_id: str, why: str) -> None:
        logger = self._refusals.get(worker_id)
        if logger is None:
            what = f"step timings from {clip(worker_id)!r} refused"
            logger = self._refusals[worker_id] = RateLimitedLog(log, what)
        logger.warn(why)

    def forget(self, worker_id: str) -> None:
        self.step_windows.forget(worker_id)
        self._refusals.pop(worker_id, None)
        if self.trace is not None:
            self.trace.left(worker_id)

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
        if not asked:
            raise ControlError(
                "FAILED_PRECONDITION",
                "no worker reports step timings, so none can record a trace (workers report "
                "through ControllerClient.timings; an older worker does not)",
            )
        # Ahead of every worker: two steps past the last relayed payload (the next one may be on
        # its way), and past each worker's last report by as many steps again as that report
        # held (reports lag by up to one interval; steps that no payload names, too), and further
        # by TRACE_LEAD_S of steps at its pace (a loaded host may take that long to hand the
        # request to a worker; a worker that gets it past the first step sends no spans).
        first = last_step_id + 2
        for worker_id in asked:
            window = self.step_windows.windows[worker_id]
            lag = window.reports[-1].steps if window.reports else 0
            ahead = min(math.ceil(window.steps_per_s * TRACE_LEAD_S), MAX_LEAD_STEPS)
            first = max(first, window.seen_step + lag + ahead + 2)
        if first + steps - 1 > UINT64_MAX:  # step ids are bounded (report_checks): not reached
            raise ControlError(
                "FAILED_PRECONDITION",
                f"step ids are near the 64-bit limit (next step {first}); restart the workers",
            )
        sent_at = time.monotonic()
        start = afd_pb2.TraceStart(
            trace_id=self._trace_ids + 1, first_step_id=first, steps=steps, daemon_sent_s=sent_at
        )
        self._trace_ids += 1
        self.trace = PendingTrace(self._trace_ids, first, steps, sent_at, dict(asked))
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
