"""The data plane as the vLLM extension uses it: thin adapters onto `afd_data.NixlTransport`.

Attention side, per step: `begin_step(shape)` (before the payload is published), then per layer
`exchange(layer, stage, hidden)`: write this rank's rows to every routed FFN rank, wait for
their outputs and return their sum (one FFN peer: its output); `end_step()` after the forward.
FFN side, per step: `begin_step(payload)`, per layer and stage `recv(layer, stage)` (every
attention peer's rows, concatenated in role-rank order) and `send(layer, stage, out)` (each
peer its slice), then `end_step()` before it idles.

The transports are sized from M and N (attention and FFN ranks) and the FFN groups of the
routing before registering, because the rendezvous blob describes the buffers:
`vllm_ext.control.expected_counts` asks the daemon.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from afd_ctl.routing import Role
from afd_data.partial_sums import sum_partials

if TYPE_CHECKING:
    from vllm_ext.exchange.gpu import GpuPath
    from vllm_ext.exchange.timing import ExchangeTimings
    from vllm_ext.metrics import AttentionMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShape:
    """Token counts of one step: stage -> count per attention DP rank."""

    step_id: int
    stages: dict[int, list[int]] = field(default_factory=dict)
    epoch: int | None = None
    # A warm-up, profile or capture step (the payload's flags): the attention side may compile
    # its model or capture CUDA graphs inside it, so its waits get the warm-up bound.
    warmup: bool = False

    def per_stage(self) -> list[list[int]]:
        return [self.stages[s] for s in sorted(self.stages)]


def _transport(name: str, role: Role, rank: int, *, num_attention: int, num_ffn: int,
               hidden_size: int, dtype: torch.dtype, max_tokens: int, timeout_s: float,
               router: tuple[int, str], attention_tp_size: int = 1,
               num_stages: int | None = None, ffn_groups: int | None = None) -> Any:  # fmt: skip
    from afd_data import NixlTransport, TransportConfig

    # AFD_DATA_<FIELD> environment variables tune the rest (polling, bounds, progress thread).
    config = TransportConfig.from_env(
        hidden_size=hidden_size,
        max_tokens_per_peer=max_tokens,
        dtype=str(dtype),
        num_attention=num_attention,
        num_ffn=num_ffn,
        ffn_groups=ffn_groups,  # afd-ctl's (vllm_ext.control.expected_counts); None: default
        recv_timeout_s=timeout_s,
        router_width=router[0],
        router_dtype=router[1],
        attention_tp_size=attention_tp_size,
        num_stages=num_stages,
    )
    return NixlTransport(f"afd-{name}-{time.time_ns()}", role, rank, config, device=_device())


def _device() -> str:
    """Where the worker's model runs: its buffers live there (VRAM of the worker's current
    CUDA device on GPU, so NIXL writes GPU to GPU; host DRAM on CPU)."""
    from vllm_ext import compat

    if compat.seams().on_cpu():
        return "cpu"
    return f"cuda:{torch.cuda.current_device()}"


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _tensor(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy torch view of a transport buffer (numpy on CPU, torch on CUDA)."""
    if isinstance(array, torch.Tensor):
        return array
    t = torch.from_numpy(array)
    return t.view(dtype) if t.dtype != dtype else t


class _Exchange:
    """What both roles do with their transport: build it, rendezvous, size steps, close."""

    ROLE: Role

    def __init__(
        self,
        *,
        name: str,
        rank: int,
        dtype: torch.dtype,
        router: tuple[int, str],
        warmup_timeout_s: float | None = None,
        **sizes: Any,
    ) -> None:
        self.dtype = dtype
        self.router_dtype = _torch_dtype(router[1])
        self.transport = _transport(name, self.ROLE, rank, dtype=dtype, router=router, **sizes)
        self.warmup_timeout_s = warmup_timeout_s
        self.timeout_s: float = sizes["timeout_s"]
        # This step's bound on each wait for the peers' rows or outputs (None: timeout_s).
        self.wait_bound_s: float | None = None
        # The GPU-driven hop, where the buffers are CUDA memory; used when connect chooses it.
        self.gpu: GpuPath | None = None
        if self.transport.device != "cpu":
            from vllm_ext.exchange.gpu import GpuPath

            self.gpu = GpuPath(self.transport)
        self.plan: Any = None  # the open step's afd_data StepPlan on the GPU path
        # Issue 26: per-step timings to afd-ctl, host path only (peer_link sets it), from the
        # seconds spent posting/sending and waiting, counted over the whole run.
        self.timings: ExchangeTimings | None = None
        self.post_s = self.wait_s = 0.0

    @property
    def path(self) -> str:
        """ "gpu" (the GPUs drive the hop) or "nixl" (the host does), as chosen at connect."""
        return "gpu" if self.gpu is not None and self.gpu.active else "nixl"

    @property
    def step_bound_s(self) -> float:
        return self.wait_bound_s if self.wait_bound_s is not None else self.timeout_s

    def blob(self) -> bytes:
        return self.transport.blob()

    def connect(self, view: Any) -> None:
        """Connects to the view's peers; a shape mismatch names the vLLM/AFD settings behind
        it."""
        from afd_data.errors import AfdBadInput
        from afd_data.rendezvous import peers_from_view

        try:
            if self.gpu is not None:
                self.gpu.drain("reconnecting to a new membership")
            self.transport.reconnect(view.epoch, peers_from_view(view))
            if self.gpu is not None:
                self.gpu.connect(view.epoch, self.warmup_timeout_s or self.timeout_s)
        except AfdBadInput as exc:
            if "buffer shape differs" not in str(exc):
                raise
            raise AfdBadInput(
                f"{exc}. With vLLM these follow from settings both roles must share: --dtype, "
                "the model (hidden size, experts), afd max_tokens (or --max-num-batched-tokens), "
                "and afd gate"
            ) from None

    def begin_step(self, shape: StepShape) -> None:
        """Sizes the step; the FFN side also checks the payload's epoch (shape.epoch)."""
        self.wait_bound_s = self.warmup_timeout_s if shape.warmup else None
        if self.path == "gpu":
            assert self.gpu is not None
            lost, epoch = self.transport.lost, self.transport.epoch
            if lost is not None:
                raise lost
            if shape.epoch is not None and shape.epoch != epoch:
                from afd_data.errors import AfdStaleEpoch

                raise AfdStaleEpoch(f"step {shape.step_id} is of epoch {shape.epoch}, the data "
                                    f"plane of epoch {epoch}")  # fmt: skip
            self.plan = self.gpu.plan(shape.per_stage())
            return
        self.transport.begin_step(shape.step_id, shape.per_stage(), epoch=shape.epoch)
        if self.timings is not None:
            self.timings.begin(shape.step_id, self)

    def end_step(self) -> None:
        if self.path == "gpu":
            return  # each role ends a GPU-driven step itself (end_step_gpu / step_enqueued)
        self.transport.end_step()
        if self.timings is not None:
            self.timings.end(self)

    def close(self) -> None:
        try:
            if self.gpu is not None:
                self.gpu.close()
        finally:
            self.transport.close()


class AttentionExchange(_Exchange):
    ROLE = Role.ATTENTION

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Seconds spent staging and posting hidden states, and waiting for the outputs, over
        # `exchanges` layer exchanges (where a step's AFD time goes; see stats()).
        self.post_s = self.wait_s = 0.0
        self.exchanges = 0
        self.metrics: AttentionMetrics | None = None  # afd_hop_seconds and the byte counts
        # Per stage: when its rows left and how many bytes went (for the hop metrics).
        self._sent: dict[int, tuple[float, int, int]] = {}

    def stats(self) -> dict[str, float]:
        n = max(1, self.exchanges)
        return {
            "gpu_driven": float(self.path == "gpu"),
            "exchanges": self.exchanges,
            "post_us_per_layer": 1e6 * self.post_s / n,
            "wait_us_per_layer": 1e6 * self.wait_s / n,
        }

    def exchange(
        self,
        layer: int,
        stage: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's round trip: `send`, then `recv`."""
        self.send(layer, stage, hidden_states, router_logits)
        return self.recv(layer, stage, hidden_states)

    def exchange_into(
        self,
        layer: int,
        stage: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """One layer's round trip into `out`. On the GPU path it is only enqueued on the
        current stream (or captured in a CUDA graph): no host wait until `end_step_gpu`."""
        if self.path == "gpu":
            assert self.gpu is not None
            if router_logits is None and self.transport.config.router_width:
                router_logits = torch.zeros(hidden_states.shape[0], self.transport.config.router_width,
                                            dtype=self.router_dtype, device=hidden_states.device)  # fmt: skip
            self.gpu.exchange(layer, stage, hidden_states, router_logits, out)
            self.exchanges += 1
            return
        out.copy_(self.exchange(layer, stage, hidden_states, router_logits))

    def end_step_gpu(self) -> None:
        """The GPU path's end of a step on the host: waits for it (bounded); a loss or an
        overrun fails it (AfdPeerLost / AfdTimeout) before vLLM reads its outputs."""
        assert self.gpu is not None
        t0 = time.perf_counter()
        self.gpu.end_step(self.step_bound_s)
        self.wait_s += time.perf_counter() - t0

    def send(
        self,
        layer: int,
        stage: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
    ) -> None:
        """Stages this layer's rows in the registered buffer and posts them to the FFN peers.
        `router_logits`: with the gate on the attention side, this MoE layer's logits (a
        dense layer sends zeros in those columns)."""
        t0 = time.perf_counter()
        n = hidden_states.shape[0]
        if self.timings is not None:
            self.timings.span("attention", layer)
            self.timings.count(layer, n, hidden_states.nbytes)
        staged, staged_router = self.transport.hidden_buffer(layer, stage)
        _tensor(staged, self.dtype)[:n].copy_(hidden_states.reshape(n, -1))
        if staged_router is not None:
            columns = _tensor(staged_router, self.router_dtype)[:n]
            if router_logits is None:
                columns.zero_()
            else:
                columns.copy_(router_logits.reshape(n, -1))
        elif router_logits is not None:
            raise RuntimeError("afd: router logits given but the data plane carries none")
        self.transport.send_hidden(layer, stage, staged, staged_router)
        self.post_s += time.perf_counter() - t0
        if self.timings is not None:
            self.timings.span("send", layer)
        if self.metrics is not None:
            row = hidden_states.element_size() * (hidden_states.numel() // max(1, n))
            sent = row + (0 if router_logits is None else router_logits[:1].nbytes)
            self._sent[stage] = (t0, n * sent, n * row)

    def recv(self, layer: int, stage: int, like: torch.Tensor) -> torch.Tensor:
        """Waits for this layer's output from every FFN peer and sums them (expert-parallel
        FFN ranks return partial sums); shaped like the rows sent (`like`)."""
        t1 = time.perf_counter()
        if self.timings is not None:
            self.timings.mark()
        outputs = self.transport.recv_outputs(layer, stage, timeout_s=self.wait_bound_s)
        t2 = time.perf_counter()
        self.wait_s += t2 - t1
        self.exchanges += 1
        if self.timings is not None:
            self.timings.span("wait", layer)
        n = like.shape[0]
        parts = [_tensor(o, self.dtype)[:n] for o in outputs]
        out = sum_partials(torch.empty_like(parts[0]), parts)  # float32, rounded once (issue 23)
        sent = self._sent.pop(stage, None)
        if self.metrics is not None and sent is not None:
            t0, sent_bytes, row_bytes = sent
            self.metrics.hop(t2 - t0, sent_bytes * len(outputs), row_bytes * len(outputs))
        return out.view_as(like)


class FfnExchange(_Exchange):
    ROLE = Role.FFN

    def recv(self, layer: int, stage: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every peer's rows, concatenated, and their router logits (gate on the attention
        side) or None."""
        t0 = time.perf_counter()
        if self.timings is not None:
            self.timings.mark()
        batch = self.transport.recv_hidden(layer, stage, timeout_s=self.wait_bound_s)
        router = None if batch.router is None else _tensor(batch.router, self.router_dtype)
        hidden = _tensor(batch.hidden, self.dtype)
        self.wait_s += time.perf_counter() - t0
        if self.timings is not None:
            self.timings.count(layer, hidden.shape[0], hidden.nbytes)
            self.timings.span("recv_wait", layer)
        return hidden, router

    def send(self, layer: int, stage: int, output: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if self.timings is not None:
            self.timings.span("ffn_compute", layer)
        staged = self.transport.output_buffer(layer, stage)
        _tensor(staged, self.dtype).copy_(output)
        self.transport.send_output(layer, stage, staged)
        self.post_s += time.perf_counter() - t0
        if self.timings is not None:
            self.timings.span("return", layer)
