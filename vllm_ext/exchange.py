"""The data plane as the vLLM extension uses it: thin adapters onto `afd_data.NixlTransport`.

Attention side, per step: `begin_step(shape)` (before the payload is published), then per layer
`exchange(layer, stage, hidden)`: write this rank's rows to every routed FFN rank, wait for
their outputs and return their sum (one FFN peer: its output); `end_step()` after the forward.
FFN side, per step: `begin_step(payload)`, per layer and stage `recv(layer, stage)` (every
attention peer's rows, concatenated in role-rank order) and `send(layer, stage, out)` (each
peer its slice), then `end_step()` before it idles.

The transports are sized from M and N (attention and FFN ranks) before registering, because
the rendezvous blob describes the buffers: `expected_counts` asks the daemon.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from afd_ctl.routing import Role

if TYPE_CHECKING:
    from vllm_ext.control import ControlAccess
    from vllm_ext.metrics import AttentionMetrics

log = logging.getLogger(__name__)

# While afd-ctl does not answer at start-up: say so at once, then this often.
UNANSWERED_LOG_S = 10.0


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


def expected_counts(access: ControlAccess, timeout_s: float) -> tuple[int, int]:
    """(attention ranks M, FFN ranks N) the daemon expects, waiting for it to answer; wrong
    credentials fail at once (AfdCredentialsRefused), saying so."""
    import grpc

    from afd_ctl.v1 import afd_pb2
    from vllm_ext.control import StatusQuery

    started = time.monotonic()
    deadline = started + timeout_s
    next_log = started  # the first failure is said at once, then every UNANSWERED_LOG_S
    query = StatusQuery(access)
    controller = access.describe()
    try:
        while True:
            try:
                status = query.get(timeout_s=5)
                break
            except grpc.RpcError as exc:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(
                        f"afd-ctl at {controller} did not answer within {timeout_s:.0f} s "
                        f"({exc.code().name}: {exc.details()}); is `afd-ctl serve` running "
                        "there, with the TLS settings this worker has?"
                    ) from None
                if now >= next_log:
                    if next_log == started:
                        log.warning(
                            "afd: afd-ctl at %s does not answer (%s); is `afd-ctl serve` running "
                            "there? Retrying for up to %.0f s (afd connect_timeout_s)",
                            controller,
                            exc.code().name,
                            timeout_s,
                        )
                    else:
                        log.warning(
                            "afd: afd-ctl at %s still does not answer after %.0f s (%s); "
                            "retrying for another %.0f s",
                            controller,
                            now - started,
                            exc.code().name,
                            deadline - now,
                        )
                    next_log = now + UNANSWERED_LOG_S
                time.sleep(0.5)
    finally:
        query.close()
    counts = {r.role: r.expected for r in status.roles}
    return counts[afd_pb2.ATTENTION], counts[afd_pb2.FFN]


def _transport(name: str, role: Role, rank: int, *, num_attention: int, num_ffn: int,
               hidden_size: int, dtype: torch.dtype, max_tokens: int, timeout_s: float,
               router: tuple[int, str], attention_tp_size: int = 1,
               num_stages: int | None = None) -> Any:  # fmt: skip
    from afd_data import NixlTransport, TransportConfig

    # AFD_DATA_<FIELD> environment variables tune the rest (polling, bounds, progress thread).
    config = TransportConfig.from_env(
        hidden_size=hidden_size,
        max_tokens_per_peer=max_tokens,
        dtype=str(dtype),
        num_attention=num_attention,
        num_ffn=num_ffn,
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
        # This step's bound on each wait for the peers' rows or outputs (None: timeout_s).
        self.wait_bound_s: float | None = None

    def blob(self) -> bytes:
        return self.transport.blob()

    def connect(self, view: Any) -> None:
        """Connects to the view's peers; a shape mismatch names the vLLM/AFD settings behind
        it."""
        from afd_data.errors import AfdBadInput
        from afd_data.rendezvous import peers_from_view

        try:
            self.transport.reconnect(view.epoch, peers_from_view(view))
        except AfdBadInput as exc:
            if "buffer shape differs" not in str(exc):
                raise
            raise AfdBadInput(
                f"{exc}. With vLLM these follow from settings both roles must share: --dtype, "
                "the model (hidden size, experts), afd max_tokens (or --max-num-batched-tokens), "
                "afd gate, and on the FFN servers afd attention_tp_size = the attention servers' "
                "--tensor-parallel-size"
            ) from None

    def begin_step(self, shape: StepShape) -> None:
        """Sizes the step; the FFN side also checks the payload's epoch (shape.epoch)."""
        self.transport.begin_step(shape.step_id, shape.per_stage(), epoch=shape.epoch)
        self.wait_bound_s = self.warmup_timeout_s if shape.warmup else None

    def end_step(self) -> None:
        self.transport.end_step()

    def close(self) -> None:
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
        if self.metrics is not None:
            row = hidden_states.element_size() * (hidden_states.numel() // max(1, n))
            sent = row + (0 if router_logits is None else router_logits[:1].nbytes)
            self._sent[stage] = (t0, n * sent, n * row)

    def recv(self, layer: int, stage: int, like: torch.Tensor) -> torch.Tensor:
        """Waits for this layer's output from every FFN peer and sums them (expert-parallel
        FFN ranks return partial sums); shaped like the rows sent (`like`)."""
        t1 = time.perf_counter()
        outputs = self.transport.recv_outputs(layer, stage, timeout_s=self.wait_bound_s)
        t2 = time.perf_counter()
        self.wait_s += t2 - t1
        self.exchanges += 1
        n = like.shape[0]
        out = _tensor(outputs[0], self.dtype)[:n].clone()
        for extra in outputs[1:]:
            out.add_(_tensor(extra, self.dtype)[:n])
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
        batch = self.transport.recv_hidden(layer, stage, timeout_s=self.wait_bound_s)
        router = None if batch.router is None else _tensor(batch.router, self.router_dtype)
        return _tensor(batch.hidden, self.dtype), router

    def send(self, layer: int, stage: int, output: torch.Tensor) -> None:
        staged = self.transport.output_buffer(layer, stage)
        _tensor(staged, self.dtype).copy_(output)
        self.transport.send_output(layer, stage, staged)
