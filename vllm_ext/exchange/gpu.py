"""The GPU-driven exchange (afd_data.gpu_hop): the GPUs run the per-layer hop themselves with
stream-ordered copies and flag words, so nothing in a layer waits on a host.

Attention side: `post` and `take` only enqueue their halves of a layer's round trip on the
current CUDA stream (vLLM's FULL decode graphs capture them); `end_step` records the step's end
and returns at once, so vLLM's host goes on to schedule and prepare the next step while the
GPUs run this one (its async scheduling survives). A watchdog thread (vllm_ext.exchange.
gpu_watchdog) releases a step stuck on a lost peer or past its bound with poison, and the
step's verdict (`settle`) is asked where vLLM first reads its sampled tokens: a failed step's
tokens never reach a client.

FFN side (vllm_ext.exchange.gpu_ffn): `run_step` enqueues every layer of the step (wait for the
rows, compute, answer) at once, or launches it as one CUDA graph (vllm_ext.exchange.gpu_graphs),
and the host goes on to the next payload; `check`, between payloads, notices a step that failed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from afd_ctl.step import Counts, Step
from afd_data.cuda_driver import driver
from afd_data.gpu_protocol import GPU
from afd_data.step_plan import validate_counts
from vllm_ext.exchange.data_plane import DataPlane
from vllm_ext.exchange.gpu_events import CudaEvent, EventPool, current_stream_of
from vllm_ext.exchange.gpu_watchdog import InFlight, StepWatchdog, failure_error
from vllm_ext.exchange.timeline import Timeline
from vllm_ext.exchange.timing import Reporting

log = logging.getLogger(__name__)

RECENT_STEPS = 1000
# Step plans kept per view (one per shape served: decode sizes, prefill chunks).
MAX_PLANS = 512


@dataclasses.dataclass(frozen=True)
class HostSide:
    """What the host's side of a GPU-driven exchange calls: the CUDA driver (its timing
    events), the current stream's handle, and the hop that enqueues each layer's operations."""

    cuda: Any
    stream: Callable[[], int]
    hop: Any


class GpuSide:
    """What both roles' GPU-driven exchanges share: the plane, the watchdog, reports."""

    path = GPU
    has_verdicts = False  # the attention side's steps are settled where vLLM reads tokens

    def __init__(
        self, plane: DataPlane, reporting: Reporting, host: HostSide | None = None
    ) -> None:
        """`host`: the driver, stream reader and hop to use instead of the plane's and this
        process's (benchmarks/attention_host_step.py runs the attention host's part on CPU)."""
        self.plane = plane
        self.hop = host.hop if host is not None else plane.hop
        self.device = plane.device
        self.reporting = reporting
        self.bound_s = plane.timeout_s
        self.watchdog = StepWatchdog(
            poison=self.hop.poison, lost=plane.lost_reason, mark_lost=plane.mark_lost
        )
        config = plane.config
        self._row_bytes = config.hidden_size * config.itemsize
        self._row_bytes += config.router_width * config.router_itemsize
        self._gpu_s: deque[float] = deque(maxlen=RECENT_STEPS)
        self.timeline = Timeline(plane.role.label, plane.rank, verdicts=self.has_verdicts)
        if host is not None:
            self.stream, cuda = host.stream, host.cuda
        else:
            self.stream = current_stream_of(torch.device(plane.device))  # a cheap handle read
            cuda = driver()
        self.events = EventPool(cuda, self.stream)
        # Reporting retired steps: taking them from the watchdog, then reporting them.
        self.retire_take_s = self.retire_report_s = 0.0
        self.retire_calls = 0

    def _report_retired(self, look: bool = True) -> None:
        """Steps that ran to their end, into the step timings (on the host's thread); `look`:
        also those whose end passed since the last verdict or round (a driver call)."""
        timings = self.reporting.timings
        t0 = time.perf_counter()
        taken = self.watchdog.take_retired(look)
        t1 = time.perf_counter()
        for retired in taken:
            if retired.gpu_s > 0:
                self._gpu_s.append(retired.gpu_s)
            if timings is not None:
                timings.gpu_step(retired)
            self.timeline.step(retired)
            self.events.give_back(retired.start, retired.end)
        self.retire_take_s += t1 - t0
        self.retire_report_s += time.perf_counter() - t1
        self.retire_calls += 1

    def _nbytes(self, rows: int) -> int:
        """Bytes both ways over every layer of a step of `rows` rows."""
        timings = self.reporting.timings
        layers = timings.reporter.layers if timings is not None else 0
        return 2 * rows * self._row_bytes * layers

    def _gpu_stats(self) -> dict[str, float]:
        if not self._gpu_s:
            return {}
        ordered = sorted(self._gpu_s)
        return {"gpu_ms_per_step_median": 1e3 * ordered[len(ordered) // 2]}

    def drain(self, reason: str) -> None:
        """Before a reconnect or close: every enqueued step leaves the stream (released with
        poison past the bound); then new steps may run again."""
        self.watchdog.drain(reason, self.plane.warmup_timeout_s or self.plane.timeout_s)
        self._report_retired()
        self.watchdog.reset()

    def connected(self) -> None:
        """Nothing to do on the attention side (its graphs touch only its own memory)."""

    def close(self) -> None:
        self.watchdog.stop()
        self.timeline.close()


class GpuAttentionExchange(GpuSide):
    full_graphs = True
    has_verdicts = True

    def __init__(
        self, plane: DataPlane, reporting: Reporting, host: HostSide | None = None
    ) -> None:
        super().__init__(plane, reporting, host)
        device = torch.device(plane.device)
        plane.transport.loss.listeners.append(self.watchdog.wake)  # a loss is seen at once
        # Its driver calls (the poison) need the worker's CUDA device current on its thread.
        if device.type == "cuda":
            self.watchdog.start(setup=lambda: torch.cuda.set_device(device))
        else:
            self.watchdog.start()
        self.exchanges = 0
        self.settle_s = 0.0  # the host's waits for verdicts
        self.settle_cpu_s = 0.0  # ... of which its thread's CPU time (the rest: waiting)
        self.settles = 0  # ... of this many steps
        self._step: Step | None = None
        self._opened_at = 0.0
        self._published_at = 0.0
        self._start: CudaEvent | None = None
        self._checked: set[Counts] = set()  # step counts checked in this view

    def stats(self) -> dict[str, float]:
        n = max(1, self.exchanges)
        return {
            "gpu_driven": 1.0,
            "exchanges": self.exchanges,
            "post_us_per_layer": 0.0,  # the host only enqueues
            "wait_us_per_layer": 1e6 * self.settle_s / n,
            # A replayed FULL graph exchanges without the host: its wait is the verdict's.
            "settle_us_per_step": 1e6 * self.settle_s / max(1, self.settles),
            "settle_cpu_us_per_step": 1e6 * self.settle_cpu_s / max(1, self.settles),
            "retire_take_us_per_call": 1e6 * self.retire_take_s / max(1, self.retire_calls),
            "retire_report_us_per_call": 1e6 * self.retire_report_s / max(1, self.retire_calls),
            "steps_in_flight": self.watchdog.in_flight,
            **self._gpu_stats(),
            **self._watch_stats(),
        }

    def _watch_stats(self) -> dict[str, float]:
        steps = max(1, self.watchdog.enqueued)
        return {
            "watchdog_rounds_per_step": round(self.watchdog.thread_rounds / steps, 3),
            "watchdog_us_per_step": round(1e6 * self.watchdog.thread_s / steps, 1),
        }

    def connected(self) -> None:
        self._checked.clear()  # the new view's sizes

    def begin_step(self, step: Step) -> None:
        self.plane.check_step(step)
        if step.counts not in self._checked:  # decode steps repeat a few shapes
            validate_counts(self.plane.config, step.counts)
            if len(self._checked) >= MAX_PLANS:
                self._checked.clear()
            self._checked.add(step.counts)
        if self.watchdog.fatal is not None:
            raise RuntimeError(self.watchdog.fatal)
        self.bound_s = self.plane.bound_s(step)
        self._step = step
        self._opened_at = self._published_at = time.monotonic()
        # A FULL-graph capture step records the exchange and runs nothing: no events.
        self._start = None if step.flags.records_only else self.events.recorded()

    def published(self) -> None:
        """The payload is out: the steps retired since the last one are reported now, off
        the control hop's path (they used to delay the publish)."""
        self._published_at = time.monotonic()
        # Those the verdicts retired: every step's verdict is asked within a step or two.
        self._report_retired(look=False)

    def post(
        self, layer: int, stage: int, hidden: torch.Tensor, router: torch.Tensor | None
    ) -> None:
        width = self.plane.config.router_width
        if router is None and width:
            router = torch.zeros(
                hidden.shape[0], width, dtype=self.plane.router_dtype, device=hidden.device
            )
        self.hop.send(layer, stage, hidden, router, self.stream())

    def take(self, layer: int, stage: int, out: torch.Tensor) -> None:
        self.hop.take(layer, stage, out, self.stream())
        self.exchanges += 1

    def end_step(self) -> None:
        """Closes the step without waiting: its end event goes to the watchdog."""
        step, self._step = self._step, None
        if step is None or self._start is None:
            return  # a recorded FULL graph runs nothing now
        if step.flags.is_graph_capturing and torch.cuda.is_current_stream_capturing():
            return  # (a driver call: only where a capture may be recording)
        now = time.monotonic()
        rows = sum(max(1, row[self.plane.rank]) for row in step.counts)
        self.watchdog.enqueue(
            InFlight(
                step.step_id,
                self._start,
                self.events.recorded(),
                self.bound_s,
                enqueued_at=now,
                host_s=now - self._opened_at,
                tokens=rows,
                nbytes=self._nbytes(rows),
                warmup=step.warmup,
                control_at=self._published_at,
            )
        )
        if self.reporting.timings is not None:
            self.reporting.timings.host_span(step.step_id, self._opened_at, now)

    def raise_failure(self) -> None:
        why = self.watchdog.take_failure()
        if why is not None:
            raise failure_error(why)

    def settle(self, step_ids: Sequence[int]) -> None:
        if self.timeline.on:  # vLLM's own wait for these steps' tokens just ended
            asked = time.monotonic()
            for step_id in step_ids:
                self.timeline.tokens(step_id, asked)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            self.watchdog.verdict(step_ids, self.bound_s)
        finally:
            self.settle_s += time.perf_counter() - t0
            self.settle_cpu_s += time.thread_time() - cpu0
            self.settles += len(step_ids)
