"""The GPU-driven exchange's FFN side (afd_data.gpu_hop; vllm_ext.exchange.gpu has what both
roles share and the attention side).

`run_step` enqueues every layer of the step (wait for the rows, compute, answer) at once, or
launches it as one CUDA graph (vllm_ext.exchange.gpu_graphs), and the host goes on to the next
payload; `check`, between payloads, notices a step that failed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from afd_ctl.step import CAPTURE, EAGER, Counts, Step
from afd_data.errors import AfdPeerLost
from afd_data.step_plan import StepPlan, plan_step, validate_counts
from vllm_ext.exchange.base import StepSplit
from vllm_ext.exchange.data_plane import DataPlane
from vllm_ext.exchange.gpu import MAX_PLANS, GpuSide
from vllm_ext.exchange.gpu_graphs import FfnStepGraphs
from vllm_ext.exchange.gpu_watchdog import LOST, InFlight
from vllm_ext.exchange.timing import Reporting


class GpuFfnExchange(GpuSide):
    def __init__(self, plane: DataPlane, reporting: Reporting, engine: Any, graphs: bool) -> None:
        super().__init__(plane, reporting)
        self.engine = engine
        # A whole step as one CUDA graph (GPU, not eager).
        self.step_graphs = FfnStepGraphs(enabled=graphs)
        self._plans: dict[Counts, StepPlan] = {}

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = {**self.step_graphs.stats(), **self._gpu_stats()}
        if self.step_graphs.captures:  # the GPU-driven path keys whole steps
            stats["graph_keys"] = len(self.step_graphs.keys_in_capture_steps)
        return stats

    def connected(self) -> None:
        self.step_graphs.reset()  # they hold the previous peers' mapped addresses
        self._plans.clear()  # the new view's peers and sizes

    def _plan(self, counts: Counts) -> StepPlan:
        """The step plan of these per-stage counts, checked and made once per view: decode
        steps repeat a few shapes, and the FFN host's time before its launch is on the step's
        path whenever the attention host does not run ahead."""
        plan = self._plans.get(counts)
        if plan is None:
            config = self.plane.config
            checked = validate_counts(config, counts)
            plan = plan_step(config, self.plane.role, self.plane.rank, checked)
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[counts] = plan
        return plan

    def run_step(self, step: Step, received_at: float = 0.0) -> StepSplit:
        """Every layer of `step` onto the stream at once (or its step graph launched); the host
        moves on to the next payload. The host's time here is enqueueing, counted as compute.
        `received_at`: when its payload was taken (monotonic; the timeline's stamp)."""
        self.plane.check_step(step)
        plan = self._plan(step.counts)
        ops = functools.partial(self._step_ops, step, plan)  # built only where a step needs them
        if step.flags.records_only:
            # The attention side records a FULL graph for these counts and runs nothing: this
            # side captures its step graph and runs nothing either.
            if self.step_graphs.enabled:
                with self.engine.step_scope():
                    self.step_graphs.capture(step.graph_key, ops)
            return StepSplit()
        # Nothing before the launch but what the launch needs: the steps retired since the
        # last payload are reported by `check`, after it.
        self.bound_s = self.plane.bound_s(step)
        t0 = time.perf_counter()
        opened = time.monotonic()
        start = self.events.recorded()
        mode = step.flags.graph_mode(self.step_graphs.enabled)
        with self.engine.step_scope():
            if mode != EAGER:
                self.step_graphs.run(step.graph_key, mode == CAPTURE, ops)
            else:
                _, enqueue = ops()
                enqueue()
        now = time.monotonic()
        rows = sum(plan.total_rows)
        end = self.events.recorded()
        self.watchdog.enqueue(
            InFlight(
                step.step_id,
                start,
                end,
                self.bound_s,
                now,
                now - opened,
                rows,
                self._nbytes(rows),
                step.warmup,
                control_at=received_at,
            )
        )
        self.check()
        return StepSplit(compute_s=time.perf_counter() - t0)

    def _step_ops(
        self, step: Step, plan: StepPlan
    ) -> tuple[Callable[[], None], Callable[[], None]]:
        """(warm_up, enqueue) of a step: each layer's compute once outside any graph (lazy
        initialisations), and every layer's stream operations (afd_data.gpu_hop: wait for the
        rows, compute, answer)."""
        hop, forward = self.hop, self.engine.forward_layer
        stages = range(step.stages)
        layers = [(layer, stage) for layer in range(self.engine.num_layers) for stage in stages]

        def run(layer: int, x: Any, router: Any) -> Any:
            return forward(layer, x) if router is None else forward(layer, x, router)

        def enqueue() -> None:
            stream = self.stream()
            for layer, stage in layers:
                compute = functools.partial(run, layer)
                hop.ffn_layer(layer, stage, plan.slices[stage], stream, compute)

        def warm_up() -> None:
            for layer, stage in layers:
                run(layer, *hop.ffn_inputs(layer, stage, plan.slices[stage]))

        return warm_up, enqueue

    def check(self) -> None:
        failure = self.watchdog.poll()
        self._report_retired(look=False)  # the round just retired what had ended
        if self.watchdog.fatal is not None:
            raise RuntimeError(self.watchdog.fatal)
        if failure is not None:
            raise AfdPeerLost(failure.removeprefix(LOST))  # the FFN loop reconnects on a loss
