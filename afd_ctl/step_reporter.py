"""The worker side of issue 26: per-step timing aggregates and, when asked, trace spans.

A worker calls `step(...)` once per step with what it already measures; every `interval_s`
the reporter hands one `StepTimings` (sums, plus per-step compute and wait for histograms) to
`send`, which queues it on the Session stream without blocking (a full queue drops it). A
timer thread (started by the first step) also sends what is pending once the worker has been
idle for `idle_flush_s`, so `afd-ctl status` is current within about half a second of the last
step instead of waiting for the next one. The timer sleeps while nothing is pending (the first
step of a report wakes it) and otherwise until that report falls due: no wake-ups of an idle
worker, one of a busy worker per `idle_flush_s`. Warm-up, profile and capture steps (`warmup=True`)
go in reports of their own, which the daemon counts apart from serving. Spans are recorded
only while the daemon has asked for a trace (`afd-ctl trace`): `tracing(step_id)` is one
comparison when it has not, so tracing costs nothing when off.

Times are the worker's `time.monotonic()`; the daemon aligns clocks (see `TraceStart`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from afd_ctl.report_checks import MAX_STEP_ENTRIES
from afd_ctl.threads import named_thread
from afd_ctl.v1 import afd_pb2

MAX_SPANS = 20000
Send = Callable[[afd_pb2.SessionRequest], bool]
# Pending steps are sent once the worker has run none for this long (the timer's check).
IDLE_FLUSH_S = 0.25


class StepReporter:
    def __init__(
        self,
        send: Send,
        *,
        layers: int = 0,
        interval_s: float = 1.0,
        idle_flush_s: float = IDLE_FLUSH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self.layers = layers
        self.interval_s = interval_s
        self.idle_flush_s = idle_flush_s
        self.clock = clock
        self.enabled = True
        # The exchange path the worker runs ("gpu" or "nixl"; set at each connect).
        self.exchange_path = ""
        self.sent = 0
        self.dropped = 0
        # The pending report; the step thread and the timer thread both take this lock.
        self._pending_lock = threading.Lock()
        self._pending = afd_pb2.StepTimings()
        self._since = clock()
        self._last_step_at = 0.0
        self._timer: threading.Thread | None = None
        # Set (under _pending_lock) when a report starts pending or the reporter closes.
        self._wake = threading.Condition(self._pending_lock)
        self._closed = False
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
        warmup: bool = False,
    ) -> None:
        """One finished step. `wall_s` defaults to compute + wait + send. `warmup`: a warm-up,
        profile or CUDA-graph capture step (the payload's is_warmup, is_profile or
        is_graph_capturing), reported apart from serving steps."""
        if not self.enabled:
            return
        with self._pending_lock:
            now = self.clock()
            p = self._pending
            if p.steps and p.warmup != warmup:  # warm-up and serving never share a report
                self._flush_locked(now)
                p = self._pending
            if p.steps == 0:
                p.first_step_id = step_id
                p.warmup = warmup
                self._wake.notify()  # the timer sleeps until a report is pending
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
            self._last_step_at = now
            if now - self._since >= self.interval_s:
                self._flush_locked(now)
        if self._trace_end and step_id >= self._trace_end - 1:
            self._finish_trace(step_id)
        if self._timer is None:
            self._start_timer()

    def flush(self, now: float | None = None) -> None:
        with self._pending_lock:
            self._flush_locked(now)

    def _flush_locked(self, now: float | None = None) -> None:
        p = self._pending
        self._since = self.clock() if now is None else now
        if p.steps == 0:
            return
        p.layers = self.layers
        p.exchange_path = self.exchange_path
        if self._send(afd_pb2.SessionRequest(timings=p)):
            self.sent += 1
        else:
            self.dropped += 1
        self._pending = afd_pb2.StepTimings()

    # -- the timer thread ----------------------------------------------------------------
    def _start_timer(self) -> None:
        with self._pending_lock:
            if self._timer is not None or self._closed:
                return
            self._timer = named_thread(
                self._flush_when_idle, "afd-step-reporter", os_name="afd-reporter"
            )
        self._timer.start()

    def _due_in(self, now: float) -> float | None:
        """Seconds until the pending report must go (0: now); None when nothing is pending."""
        if not self._pending.steps:
            return None
        idle_at = self._last_step_at + self.idle_flush_s
        return max(0.0, min(idle_at, self._since + self.interval_s) - now)

    def _flush_when_idle(self) -> None:
        with self._pending_lock:
            while not self._closed:
                due = self._due_in(self.clock())
                if due is None or due > 0:
                    # Nothing pending: until a step comes. Pending: until it falls due (a step
                    # meanwhile moves the idle deadline on; checked again on waking).
                    self._wake.wait(due)
                    continue
                self._flush_locked()

    def close(self) -> None:
        """Sends what is pending and stops the timer."""
        with self._pending_lock:
            self._closed = True
            self._wake.notify()
            self._flush_locked()

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
