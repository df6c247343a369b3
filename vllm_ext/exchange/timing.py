"""Per-step timings of one data-plane exchange for afd-ctl (issue 26), host path only.

The exchange keeps its own counters of time spent posting (`post_s`) and waiting (`wait_s`);
this turns them into one `StepReporter.step` per step (compute = the step's time less both)
with the step's rows and bytes, and, only while afd-ctl traces the step, into spans that
abut: each `span(name, layer)` runs from the previous mark to now. Off (no trace), a span
costs one flag check.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afd_ctl.step_reporter import StepReporter


class ExchangeTimings:
    def __init__(self, reporter: StepReporter) -> None:
        self.reporter = reporter
        self.tracing = False
        self._step: tuple[int, float, float, float] | None = None  # id, start, wait, post
        self._rows = self._bytes = 0
        self._mark = 0.0

    def begin(self, step_id: int, exchange: Any) -> None:
        now = time.monotonic()
        self._step = (step_id, now, exchange.wait_s, exchange.post_s)
        self._rows = self._bytes = 0
        self.tracing = self.reporter.tracing(step_id)
        self._mark = now

    def end(self, exchange: Any) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        step_id, t0, wait0, post0 = step
        now = time.monotonic()
        wall, wait, post = now - t0, exchange.wait_s - wait0, exchange.post_s - post0
        if self.tracing:
            self.reporter.span("step", step_id, t0, now)
        self.reporter.step(
            step_id,
            compute_s=max(0.0, wall - wait - post),
            wait_s=wait,
            send_s=post,
            tokens=self._rows,
            nbytes=self._bytes,
            wall_s=wall,
        )

    def count(self, layer: int, rows: int, nbytes: int) -> None:
        """Rows of the step (layer 0's, every stage) and bytes both ways (every layer)."""
        if layer == 0:
            self._rows += rows
        self._bytes += 2 * nbytes

    def mark(self) -> None:
        """Starts the next span now (tracing only)."""
        if self.tracing:
            self._mark = time.monotonic()

    def span(self, name: str, layer: int) -> None:
        """A span from the last mark to now, which becomes the next mark (tracing only)."""
        if self.tracing and self._step is not None:
            now = time.monotonic()
            self.reporter.span(name, self._step[0], self._mark, now, layer)
            self._mark = now
