"""Per-step timings of one worker's exchange for afd-ctl (`afd-ctl status` LOAD, `advise`,
`trace`), on both paths.

Host-driven (NIXL) path: the exchange keeps its own counters of time spent posting (`post_s`)
and waiting (`wait_s`); `begin`/`end` turn them into one `StepReporter.step` per step (compute
= the step's time less both) with the step's rows and bytes, and, only while afd-ctl traces the
step, into spans that abut: each `span(name, layer)` runs from the previous mark to now. Off
(no trace), a span costs one flag check.

GPU-driven path: the host only enqueues, so a step's time is its GPU time, from CUDA events at
its start and end that the watchdog reads once the end has passed (no sync):
`gpu_step` reports it as the step's wall and compute time (on the attention side the GPU's
waits for the FFN are inside it: the layers run inside a graph where the host sees nothing),
and a trace gets the host's span of the step plus its GPU span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afd_ctl.step_reporter import StepReporter
    from vllm_ext.exchange.gpu_watchdog import Retired
    from vllm_ext.metrics import AttentionMetrics


@dataclass
class Reporting:
    """What an exchange reports to, whichever implementation runs: set by the worker once its
    session is open (None until then)."""

    timings: ExchangeTimings | None = None
    metrics: AttentionMetrics | None = None


class ExchangeTimings:
    def __init__(self, reporter: StepReporter) -> None:
        self.reporter = reporter
        self.tracing = False
        self._step: tuple[int, float, float, float] | None = None  # id, start, wait, post
        self._warmup = False
        self._rows = self._bytes = 0
        self._mark = 0.0

    def set_path(self, path: str) -> None:
        """The exchange path the worker runs now (its reports say it)."""
        self.reporter.exchange_path = path

    def begin(self, step_id: int, exchange: Any, warmup: bool = False) -> None:
        """`warmup`: a warm-up, profile or capture step (reported apart from serving steps)."""
        now = time.monotonic()
        self._warmup = warmup
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
            warmup=self._warmup,
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

    # -- the GPU-driven path ----------------------------------------------------------------
    def host_span(self, step_id: int, start_s: float, end_s: float) -> None:
        """The host's part of a GPU-driven step (open to enqueued), when traced."""
        if self.reporter.tracing(step_id):
            self.reporter.span("step", step_id, start_s, end_s)

    def gpu_step(self, retired: Retired) -> None:
        """A GPU-driven step that ran to its end (from the host's thread)."""
        gpu_s = retired.gpu_s
        if self.reporter.tracing(retired.step_id) and gpu_s > 0:
            # Its end was seen at `ended_at` (an upper bound): the span ends there.
            end = retired.ended_at
            self.reporter.span("gpu", retired.step_id, end - gpu_s, end)
        self.reporter.step(
            retired.step_id,
            compute_s=gpu_s,
            wait_s=0.0,
            send_s=0.0,
            tokens=retired.tokens,
            nbytes=retired.nbytes,
            wall_s=gpu_s,
            warmup=retired.warmup,
        )
