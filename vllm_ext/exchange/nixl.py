"""The host-driven exchange: NIXL WRITEs posted and awaited by the host, every layer
(afd_data.NixlTransport; peers on other hosts, or host memory on CPU).

Attention side, per step: `begin_step` (before the payload is published), then per layer
`post` (stage the rows in the registered buffer, WRITE them to every routed FFN rank) and
`take` (wait for their outputs, sum them in float32); `end_step` waits for the step's last
WRITEs. FFN side: `run_step` takes each layer's rows from every attention peer (concatenated
in role-rank order, zero-copy), runs the layer's MLP/MoE (eager, or a per-layer CUDA graph as
the payload's flags say: vllm_ext.exchange.nixl_graphs) and WRITEs each peer its slice back.
Every wait is bounded by the step's bound (vllm_ext.exchange.data_plane.DataPlane.bound_s).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from afd_ctl.step import Step
from afd_data.gpu_protocol import NIXL
from afd_data.partial_sums import sum_partials
from vllm_ext.exchange.base import StepSplit
from vllm_ext.exchange.data_plane import DataPlane, as_tensor
from vllm_ext.exchange.nixl_graphs import FfnGraphRunner
from vllm_ext.exchange.timing import Reporting


class NixlAttentionExchange:
    path = NIXL
    full_graphs = False

    def __init__(self, plane: DataPlane, reporting: Reporting) -> None:
        self.plane = plane
        self.transport = plane.transport
        self.reporting = reporting
        self.device = "cpu"  # rows are staged into the registered buffer from anywhere
        self.bound_s = plane.timeout_s
        # Seconds spent staging and posting hidden states, and waiting for the outputs, over
        # `exchanges` layer exchanges (where a step's AFD time goes; see stats()).
        self.post_s = self.wait_s = 0.0
        self.exchanges = 0
        # Per stage: when its rows left and how many bytes went (for the hop metrics).
        self._sent: dict[int, tuple[float, int, int]] = {}

    def stats(self) -> dict[str, float]:
        n = max(1, self.exchanges)
        return {
            "gpu_driven": 0.0,
            "exchanges": self.exchanges,
            "post_us_per_layer": 1e6 * self.post_s / n,
            "wait_us_per_layer": 1e6 * self.wait_s / n,
        }

    def begin_step(self, step: Step) -> None:
        self.bound_s = self.plane.bound_s(step)
        self.transport.begin_step(step)
        if self.reporting.timings is not None:
            self.reporting.timings.begin(step.step_id, self, step.warmup)

    def published(self) -> None:
        """Nothing: the host-driven step's timings start at its first post."""

    def post(
        self, layer: int, stage: int, hidden: torch.Tensor, router: torch.Tensor | None
    ) -> None:
        """Stages this layer's rows in the registered buffer and posts them to the FFN peers.
        `router`: with the gate on the attention side, this MoE layer's logits (a dense layer
        sends zeros in those columns)."""
        t0 = time.perf_counter()
        n = hidden.shape[0]
        timings, metrics = self.reporting.timings, self.reporting.metrics
        if timings is not None:
            timings.span("attention", layer)
            timings.count(layer, n, hidden.nbytes)
        staged, staged_router = self.transport.hidden_buffer(layer, stage)
        as_tensor(staged, self.plane.dtype)[:n].copy_(hidden.reshape(n, -1))
        if staged_router is not None:
            columns = as_tensor(staged_router, self.plane.router_dtype)[:n]
            if router is None:
                columns.zero_()
            else:
                columns.copy_(router.reshape(n, -1))
        elif router is not None:
            raise RuntimeError("afd: router logits given but the data plane carries none")
        self.transport.send_hidden(layer, stage, staged, staged_router)
        self.post_s += time.perf_counter() - t0
        if timings is not None:
            timings.span("send", layer)
        if metrics is not None:
            row = hidden.element_size() * (hidden.numel() // max(1, n))
            sent = row + (0 if router is None else router[:1].nbytes)
            self._sent[stage] = (t0, n * sent, n * row)

    def take(self, layer: int, stage: int, out: torch.Tensor) -> None:
        """Waits for this layer's output from every FFN peer and sums them into `out`
        (expert-parallel FFN ranks return partial sums)."""
        t1 = time.perf_counter()
        timings, metrics = self.reporting.timings, self.reporting.metrics
        if timings is not None:
            timings.mark()
        outputs = self.transport.recv_outputs(layer, stage, timeout_s=self.bound_s)
        t2 = time.perf_counter()
        self.wait_s += t2 - t1
        self.exchanges += 1
        if timings is not None:
            timings.span("wait", layer)
        n = out.shape[0]
        parts = [as_tensor(o, self.plane.dtype)[:n] for o in outputs]
        sum_partials(out.view(n, -1), parts)  # float32, rounded once (issue 23)
        sent = self._sent.pop(stage, None)
        if metrics is not None and sent is not None:
            t0, sent_bytes, row_bytes = sent
            metrics.hop(t2 - t0, sent_bytes * len(outputs), row_bytes * len(outputs))

    def end_step(self) -> None:
        self.transport.end_step()
        if self.reporting.timings is not None:
            self.reporting.timings.end(self)

    def settle(self, step_ids: Sequence[int]) -> None:
        """Nothing to settle: each step's end waited for its last outputs."""

    def raise_failure(self) -> None:
        """Nothing in flight between steps."""

    def drain(self, reason: str) -> None:
        """Nothing in flight between steps (reconnect forgets an unfinished step)."""

    def connected(self) -> None:
        """Nothing to do: the transport holds the peers."""

    def close(self) -> None:
        """The plane closes the transport."""


class NixlFfnExchange:
    path = NIXL

    def __init__(self, plane: DataPlane, reporting: Reporting, engine: Any, graphs: bool) -> None:
        self.plane = plane
        self.transport = plane.transport
        self.reporting = reporting
        self.engine = engine
        self.bound_s = plane.timeout_s
        self.post_s = self.wait_s = 0.0
        # CUDA graphs per layer as the payload's capture/replay flags say (GPU, not eager).
        self.graphs = FfnGraphRunner(engine.forward_layer, enabled=graphs)

    def stats(self) -> dict[str, float]:
        return dict(self.graphs.stats())

    def run_step(self, step: Step, received_at: float = 0.0) -> StepSplit:
        if step.flags.records_only:
            raise RuntimeError(
                "afd ffn: a records_only step (a FULL-graph capture of the GPU-driven exchange) "
                "came on the host-driven path; the attention side's data plane disagrees"
            )
        self.bound_s = self.plane.bound_s(step)
        self.transport.begin_step(step)
        timings = self.reporting.timings
        if timings is not None:
            timings.begin(step.step_id, self, step.warmup)
        self.graphs.begin_step(step)
        recv_s = compute_s = send_s = 0.0
        with self.engine.step_scope():
            for layer in range(self.engine.num_layers):
                for stage in range(step.stages):
                    t0 = time.perf_counter()
                    x, router = self._recv(layer, stage)
                    t1 = time.perf_counter()
                    out = self.graphs.run(layer, stage, x, router)
                    t2 = time.perf_counter()
                    self._send(layer, stage, out)
                    recv_s += t1 - t0
                    compute_s += t2 - t1
                    send_s += time.perf_counter() - t2
        self.transport.end_step()
        if timings is not None:
            timings.end(self)
        return StepSplit(recv_s, compute_s, send_s)

    def _recv(self, layer: int, stage: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every peer's rows, concatenated, and their router logits (gate on the attention
        side) or None."""
        t0 = time.perf_counter()
        timings = self.reporting.timings
        if timings is not None:
            timings.mark()
        batch = self.transport.recv_hidden(layer, stage, timeout_s=self.bound_s)
        router = None if batch.router is None else as_tensor(batch.router, self.plane.router_dtype)
        hidden = as_tensor(batch.hidden, self.plane.dtype)
        self.wait_s += time.perf_counter() - t0
        if timings is not None:
            timings.count(layer, hidden.shape[0], hidden.nbytes)
            timings.span("recv_wait", layer)
        return hidden, router

    def _send(self, layer: int, stage: int, output: torch.Tensor) -> None:
        t0 = time.perf_counter()
        timings = self.reporting.timings
        if timings is not None:
            timings.span("ffn_compute", layer)
        staged = self.transport.output_buffer(layer, stage)
        as_tensor(staged, self.plane.dtype).copy_(output)
        self.transport.send_output(layer, stage, staged)
        self.post_s += time.perf_counter() - t0
        if timings is not None:
            timings.span("return", layer)

    def check(self) -> None:
        """Nothing in flight between steps."""

    def drain(self, reason: str) -> None:
        """Nothing in flight between steps."""

    def connected(self) -> None:
        """Per-layer graphs hold no peer addresses: they stay."""

    def close(self) -> None:
        """The plane closes the transport."""
