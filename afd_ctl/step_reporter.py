"""The worker side of issue 26: per-step timing aggregates and, when asked, trace spans.

A worker calls `step(...)` once per step with what it already measures; every `interval_s`
the reporter hands one `StepTimings` (sums, plus per-step compute and wait for histograms) to
`send`, which queues it on the Session stream without blocking (a full queue drops it). Spans
are recorded only while the daemon has asked for a trace (`afd-ctl trace`): `tracing(step_id)`
is one comparison when it has not, so tracing costs nothing when off.

Times are the worker's `time.monotonic()`; the daemon aligns clocks (see `TraceStart`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from afd_ctl.report_checks import MAX_STEP_ENTRIES
from afd_ctl.v1 import afd_pb2

MAX_SPANS = 20000
Send = Callable[[afd_pb2.SessionRequest], bool]


class StepReporter:
    def __init__(
        self,
        send: Send,
        *,
        layers: int = 0,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self.layers = layers
        self.interval_s = interval_s
        self.clock = clock
        self.enabled = True
        self.sent = 0
        self.dropped = 0
        self._pending = afd_pb2.StepTimings()
        self._since = clock()
        # Trace state; the session thread sets it, the step thread reads and clears it.
        self._lock = threading.Lock()
        self._trace: afd_pb2.TraceSpans | None = None
        self._trace_first = 0
        self._trace_end = 0  # one past the last step to record; 0: no trace
        self._trace_started_at = 0.0

    # -- per-step (the worker's step thread) ---------------------------------------------
    def step(
        self,
        step_id: int,
        *,
        compute_s: float,
        wait_s: float,
        send_s: float = 0.0,
        tokens: int = 0,
        nbytes: int = 0,
        wall_s: float | None = None,
    ) -> None:
        """One finished step. `wall_s` defaults to compute + wait + send."""
        if not self.enabled:
            return
        p = self._pending
        if p.steps == 0:
            p.first_step_id = step_id
        p.last_step_id = step_id
        p.steps += 1
        p.busy_wall_s += wall_s if wall_s is not None else compute_s + wait_s + send_s
        p.compute_s += compute_s
        p.wait_s += wait_s
        p.send_s += send_s
        p.tokens += tokens
        p.bytes += nbytes
        if len(p.step_compute_s) < MAX_STEP_ENTRIES:
            p.step_compute_s.append(compute_s)
            p.step_wait_s.append(wait_s)
            p.step_tokens.append(tokens)
        if self._trace_end and step_id >= self._trace_end - 1:
            self._finish_trace(step_id)
        now = self.clock()
        if now - self._since >= self.interval_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        p = self._pending
        self._since = self.clock() if now is None else now
        if p.steps == 0:
            return
        p.layers = self.layers
        if self._send(afd_pb2.SessionRequest(timings=p)):
            self.sent += 1
        else:
            self.dropped += 1
        self._pending = afd_pb2.StepTimings()

    # -- tracing -------------------------------------------------------------------------
    def tracing(self, step_id: int) -> bool:
        """Whether spans of `step_id` are wanted (cheap; call before timing spans)."""
        return self._trace_first <= step_id < self._trace_end

    def span(self, name: str, step_id: int, start_s: float, end_s: float, layer: int = -1) -> None:
        trace = self._trace
        if trace is None or not self.tracing(step_id) or len(trace.spans) >= MAX_SPANS:
            return
        trace.spans.add(name=name, step_id=step_id, start_s=start_s, end_s=end_s, layer=layer)

    def on_trace_start(self, start: afd_pb2.TraceStart) -> None:
        """From the session thread: record steps [first, first + steps)."""
        with self._lock:
            self._trace = afd_pb2.TraceSpans(
                trace_id=start.trace_id, worker_received_s=self.clock()
            )
            self._trace_first = start.first_step_id
            self._trace_end = start.first_step_id + start.steps

    def _finish_trace(self, step_id: int) -> None:
        with self._lock:
            trace, self._trace = self._trace, None
            self._trace_first = self._trace_end = 0
        if trace is None:
            return
        trace.worker_sent_s = self.clock()
        # Spans are few but the message can be big: sent like a report, dropped when full.
        self._send(afd_pb2.SessionRequest(trace=trace))
