"""One FFN worker's steps: each AFDControlPayload becomes a `Step` that the exchange runs
(vllm_ext.exchange: host-driven NIXL, layer by layer; or GPU-driven, the whole step enqueued
or launched as one CUDA graph), and the counts and metrics of what was served.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any

import torch

from afd_ctl.step import Step
from vllm_ext.exchange.base import FfnExchange, StepSplit
from vllm_ext.metrics import FfnMetrics

log = logging.getLogger(__name__)

STAT_WINDOW = 1000
# Served steps logged with their split: the first few (a start-up's compiles and first
# shapes), then every LOG_EVERY-th, and any whose wait, compute or send took SLOW_STEP_S or
# more (a compile or a stall inside serving: what a peer's "no outputs within" bound then
# shows). On the GPU-driven path the split is the host's enqueueing only: a stall on the GPU
# shows in the attention side's verdicts, not here.
FIRST_STEPS_LOGGED = 4
LOG_EVERY = 1000
SLOW_STEP_S = 1.0


class FfnSteps:
    def __init__(self, *, graphs: bool, worker_id: str) -> None:
        self.graphs = graphs and torch.cuda.is_available()
        self.worker_id = worker_id
        self.steps = 0
        self.two_stage_steps = 0  # steps the attention side ran as two micro-batches
        self.two_stage_replays = 0  # ... of them, replays of the attention side's CUDA graph
        # Seconds spent waiting for attention rows, computing, and writing back.
        self.recv_s = self.compute_s = self.send_s = 0.0
        self.recv_max_s = 0.0  # the longest wait of one step (a warm-up compile, a stall)
        # The same split for each of the last STAT_WINDOW steps (medians: a typical step,
        # which a long profile or prefill step does not skew).
        self._recent: deque[StepSplit] = deque(maxlen=STAT_WINDOW)

    def stats(self) -> dict[str, float]:
        n = max(1, self.steps)
        stats: dict[str, float] = {
            "steps": self.steps,
            "two_stage_steps": self.two_stage_steps,
            "two_stage_replays": self.two_stage_replays,
            "recv_wait_ms_per_step": 1e3 * self.recv_s / n,
            "recv_wait_ms_max": 1e3 * self.recv_max_s,
            "compute_ms_per_step": 1e3 * self.compute_s / n,
            "send_ms_per_step": 1e3 * self.send_s / n,
        }
        if self._recent:
            for name in ("recv", "compute", "send"):
                median = statistics.median(getattr(r, f"{name}_s") for r in self._recent)
                stats[f"{'recv_wait' if name == 'recv' else name}_ms_median"] = 1e3 * median
        return stats

    @torch.inference_mode()
    def run(
        self,
        payload: Any,
        exchange: FfnExchange,
        metrics: FfnMetrics,
        profiler: Any,
        received_at: float = 0.0,
    ) -> None:
        """One step, every layer and stage, as the exchange runs it (`received_at`: when its
        payload was taken, monotonic)."""
        step = Step.from_payload(payload)
        split = exchange.run_step(step, received_at)
        if step.flags.records_only:
            return  # a FULL-graph capture: nothing was served
        self.recv_s += split.recv_s
        self.recv_max_s = max(self.recv_max_s, split.recv_s)
        self.compute_s += split.compute_s
        self.send_s += split.send_s
        metrics.step(split.compute_s, split.recv_s, step.flags.graph_mode(self.graphs))
        self._recent.append(split)
        self.steps += 1
        self.two_stage_steps += step.stages > 1
        self.two_stage_replays += step.stages > 1 and step.flags.is_graph_replaying
        slow = max(split.recv_s, split.compute_s, split.send_s) >= SLOW_STEP_S
        if self.steps <= FIRST_STEPS_LOGGED or self.steps % LOG_EVERY == 0 or slow:
            log.info(
                "afd ffn %s: %d steps served (last %d, %d rows, %s: waited %.3f s, "
                "computed %.3f s, sent %.3f s)%s",
                self.worker_id,
                self.steps,
                step.step_id,
                step.rows(),
                exchange.path,
                split.recv_s,
                split.compute_s,
                split.send_s,
                " (a slow step)" if slow else "",
            )
        if profiler is not None:
            profiler.step(step.step_id)
