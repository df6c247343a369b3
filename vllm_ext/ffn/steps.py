"""One FFN worker's steps: what it runs for each AFDControlPayload, and its counts.

Host-driven path (NIXL): per layer and stage, the attention peers' rows in (a wait on the
host), the layer's MLP/MoE (eager, or a per-layer CUDA graph as the payload's flags say:
vllm_ext.exchange.nixl_graphs), each peer its slice back. GPU-driven path (vllm_ext.exchange.gpu): every
layer is stream work, enqueued at once or launched as one step graph (vllm_ext.exchange.gpu_graphs),
and the host goes on to the next payload.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from afd_ctl.payloads import stage_counts
from vllm_ext.exchange.gpu_graphs import FfnStepGraphs
from vllm_ext.exchange.nixl import FfnExchange, StepShape
from vllm_ext.exchange.nixl_graphs import CAPTURE, EAGER, FfnGraphRunner, graph_key
from vllm_ext.metrics import FfnMetrics

log = logging.getLogger("vllm_ext.ffn.server")

STAT_WINDOW = 1000


class FfnSteps:
    def __init__(self, engine: Any, *, graphs: bool, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        # CUDA graphs per the payload's capture/replay flags, on GPU unless enforce_eager.
        self.graphs = FfnGraphRunner(engine.forward_layer, enabled=graphs)
        # The GPU-driven path's graphs: a whole step each (vllm_ext.exchange.gpu_graphs).
        self.step_graphs = FfnStepGraphs(enabled=graphs)
        self.steps = 0
        self.two_stage_steps = 0  # steps the attention side ran as two micro-batches
        # Seconds spent waiting for attention rows, computing, and writing back.
        self.recv_s = self.compute_s = self.send_s = 0.0
        # The same split for each of the last STAT_WINDOW steps (medians: a typical step,
        # which a long profile or prefill step does not skew).
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=STAT_WINDOW)

    def stats(self) -> dict[str, float]:
        n = max(1, self.steps)
        stats = {
            "steps": self.steps,
            "two_stage_steps": self.two_stage_steps,
            "recv_wait_ms_per_step": 1e3 * self.recv_s / n,
            "compute_ms_per_step": 1e3 * self.compute_s / n,
            "send_ms_per_step": 1e3 * self.send_s / n,
            **self.graphs.stats(),
            **self.step_graphs.stats(),
        }
        if self.step_graphs.captures:  # the GPU-driven path keys whole steps
            stats["graph_keys"] = len(self.step_graphs.keys_in_capture_steps)
        if self._recent:
            for i, name in enumerate(("recv_wait", "compute", "send")):
                stats[f"{name}_ms_median"] = 1e3 * statistics.median(r[i] for r in self._recent)
        return stats

    @torch.inference_mode()
    def run(self, payload: Any, exchange: FfnExchange, metrics: FfnMetrics, profiler: Any) -> None:
        """All layers of one step: per layer and stage, the peers' rows in, their slices out.
        On the GPU-driven path the whole step goes onto the stream at once (enqueue_gpu)."""
        stages = stage_counts(payload)
        shape = StepShape(
            step_id=payload.step_id,
            stages=stages,
            epoch=payload.epoch,
            warmup=payload.is_warmup or payload.is_profile or payload.is_graph_capturing,
        )
        exchange.begin_step(shape)
        if payload.records_only:  # the attention side records a FULL graph: no rows come
            self._capture_recorded(payload, sorted(stages), exchange)
            return
        self.graphs.begin_step(payload)
        if exchange.path == "gpu":
            self._enqueue_gpu(payload, sorted(stages), exchange, metrics)
            return
        recv_s = compute_s = send_s = 0.0
        with self.engine.step_scope():
            for layer in range(self.engine.num_layers):
                for stage in sorted(stages):
                    t0 = time.perf_counter()
                    x, router = exchange.recv(layer, stage)
                    t1 = time.perf_counter()
                    out = self.graphs.run(layer, stage, x, router)
                    t2 = time.perf_counter()
                    exchange.send(layer, stage, out)
                    recv_s += t1 - t0
                    compute_s += t2 - t1
                    send_s += time.perf_counter() - t2
        exchange.end_step()
        self.recv_s += recv_s
        self.compute_s += compute_s
        self.send_s += send_s
        metrics.step(compute_s, recv_s, self.graphs.mode)
        self._served(payload.step_id, len(stages), (recv_s, compute_s, send_s), "")
        if profiler is not None:
            profiler.step(payload.step_id)

    def _served(self, step_id: int, stages: int, split: tuple[float, float, float],
                note: str) -> None:  # fmt: skip
        """Counts a step served (either path) and says so at the first and every 1000th."""
        self._recent.append(split)
        self.steps += 1
        self.two_stage_steps += stages > 1
        if self.steps == 1 or self.steps % 1000 == 0:
            log.info("afd ffn %s: %d steps served (last %d%s)", self.worker_id, self.steps,
                     step_id, note)  # fmt: skip

    def _gpu_step_ops(
        self, stages: list[int], exchange: FfnExchange
    ) -> tuple[Callable[[], None], Callable[[], None]]:
        """(warm_up, enqueue) of a GPU-driven step: each layer's compute once outside any
        graph (lazy initialisations), and every layer's stream operations (afd_data.gpu_hop:
        wait for the rows, compute, answer)."""
        assert exchange.gpu is not None
        gpu, plan = exchange.gpu, exchange.plan
        layers = [(layer, stage) for layer in range(self.engine.num_layers) for stage in stages]
        forward = self.engine.forward_layer

        def run(layer: int, x: Any, router: Any) -> Any:
            return forward(layer, x) if router is None else forward(layer, x, router)

        def enqueue() -> None:
            for layer, stage in layers:
                gpu.run_layer(layer, stage, plan, lambda x, r, layer=layer: run(layer, x, r))

        def warm_up() -> None:
            for layer, stage in layers:
                run(layer, *gpu.hop.ffn_inputs(layer, stage, plan.slices[stage]))

        return warm_up, enqueue

    def _capture_recorded(self, payload: Any, stages: list[int], exchange: FfnExchange) -> None:
        """A records_only step: the attention side records a FULL graph for these token
        counts and runs nothing, so this side captures its step graph and runs nothing."""
        if exchange.path != "gpu":
            raise RuntimeError(
                "afd ffn: a records_only step (a FULL-graph capture of the GPU-driven exchange) "
                "came on the host-driven path; the attention side's data plane disagrees"
            )
        if self.step_graphs.enabled:
            with self.engine.step_scope():
                self.step_graphs.capture(graph_key(payload), *self._gpu_step_ops(stages, exchange))

    def _enqueue_gpu(
        self, payload: Any, stages: list[int], exchange: FfnExchange, metrics: FfnMetrics
    ) -> None:
        """The GPU-driven path: every layer of the step goes onto the stream at once, and the
        host moves on to the next payload; `GpuPath.check` notices a step that overruns its
        bound. The host's time here is enqueueing, counted as compute."""
        assert exchange.gpu is not None
        gpu = exchange.gpu
        warm_up, enqueue = self._gpu_step_ops(stages, exchange)
        t0 = time.perf_counter()
        with self.engine.step_scope():
            if self.graphs.mode != EAGER and self.step_graphs.enabled:
                self.step_graphs.run(graph_key(payload), self.graphs.mode == CAPTURE, warm_up,
                                     enqueue)  # fmt: skip
            else:
                enqueue()
        gpu.step_enqueued(payload.step_id, exchange.step_bound_s)
        enqueue_s = time.perf_counter() - t0
        self.compute_s += enqueue_s
        metrics.step(enqueue_s, 0.0, self.graphs.mode)
        self._served(payload.step_id, len(stages), (0.0, enqueue_s, 0.0), ", GPU-driven")
