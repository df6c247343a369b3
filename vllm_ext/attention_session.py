"""One attention worker's AFD state: its afd-ctl session, its data plane, its step counter.

Per model forward: `begin_step` sizes the data plane for this step's token counts, then (on a
designated sender) publishes the AFDControlPayload; each proxy layer calls `exchange`; then
`end_step`. Every wait is bounded by `step_timeout_s` and fails with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from afd_ctl.errors import AfdError, AfdNotReady, AfdTimeout
from afd_ctl.payloads import make_payload
from afd_data.errors import AfdDataError
from vllm_ext import model_split
from vllm_ext.config import AfdConfig
from vllm_ext.exchange import AttentionExchange, StepShape, expected_counts
from vllm_ext.step_failures import AfdStepFailed

log = logging.getLogger(__name__)

# Before a step after a loss: how long to wait for afd-ctl's next complete view (it may be on
# its way); past that the step fails at once, so requests do not queue behind a dead FFN side.
RECONNECT_WAIT_S = 1.0


@dataclass(frozen=True)
class StepFlags:
    is_warmup: bool = False
    is_profile: bool = False
    is_graph_capturing: bool = False
    is_graph_replaying: bool = False

    def replaying(self) -> StepFlags:
        return dataclasses.replace(self, is_graph_replaying=True)


class AttentionSession:
    def __init__(self, vllm_config: Any, afd: AfdConfig) -> None:
        parallel = vllm_config.parallel_config
        self.vllm_config = vllm_config
        self.afd = afd
        self.dp_rank: int = parallel.data_parallel_rank
        self.dp_size: int = parallel.data_parallel_size
        self.tp_rank: int = 0
        self.tp_size: int = parallel.tensor_parallel_size
        if self.tp_size != 1:
            raise NotImplementedError("AFD attention with --tensor-parallel-size > 1")
        self.worker_id = afd.worker_id or f"attention-dp{self.dp_rank}"
        if afd.worker_id and self.dp_size > 1:
            self.worker_id = f"{afd.worker_id}-dp{self.dp_rank}"
        self.step_id = 0
        self._shape: StepShape | None = None
        self._client: Any = None
        self._exchange: AttentionExchange | None = None
        self._is_sender = False
        self._lock = threading.Lock()
        self._profiler: Any = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        from afd_ctl.client import ControllerClient, WorkerSpec
        from afd_data.rendezvous import follow_losses

        afd = self.afd
        model_config = self.vllm_config.model_config
        max_tokens = afd.max_tokens or self.vllm_config.scheduler_config.max_num_batched_tokens
        num_attention, num_ffn = expected_counts(afd.controller, afd.connect_timeout_s)
        if num_attention != self.dp_size * self.tp_size:
            raise ValueError(
                f"afd-ctl expects {num_attention} attention ranks but this server has "
                f"data parallel size {self.dp_size} x tensor parallel size {self.tp_size}"
            )
        self.role_rank = self.dp_rank * self.tp_size + self.tp_rank
        self._exchange = AttentionExchange(
            name=self.worker_id,
            rank=self.role_rank,
            dtype=model_config.dtype,
            num_attention=num_attention,
            num_ffn=num_ffn,
            hidden_size=model_config.hf_config.hidden_size,
            max_tokens=max_tokens,
            timeout_s=afd.step_timeout_s,
        )
        spec = WorkerSpec(
            worker_id=self.worker_id,
            role="ATTENTION",
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        self._client = ControllerClient(afd.controller, spec, data_plane_blob=self._exchange.blob())
        follow_losses(self._client, self._exchange.transport)
        registered = self._client.connect(timeout_s=afd.connect_timeout_s)
        view = self._client.wait_complete(timeout_s=afd.connect_timeout_s)
        self._is_sender = registered.is_sender
        if registered.worker.role_rank != self.role_rank:
            raise RuntimeError(
                f"afd-ctl assigned attention rank {registered.worker.role_rank}, the data plane "
                f"was built for rank {self.role_rank}"
            )
        self._exchange.connect(view)
        model_split.set_exchange(self.exchange)
        log.info(
            "afd attention %s: rank %d of %d, epoch %d, %d ffn peer(s), sender=%s, %s",
            self.worker_id,
            registered.worker.role_rank,
            view.expected_attention,
            view.epoch,
            len(view.peers),
            self._is_sender,
            afd.describe(),
        )
        if afd.profile_dir:
            self._profiler = _StepProfiler(afd, f"attention-{self.dp_rank}")

    def close(self) -> None:
        """Publishes stop (sender only), then leaves the daemon; idempotent."""
        with self._lock:
            client, self._client = self._client, None
            exchange, self._exchange = self._exchange, None
        model_split.set_exchange(None)
        if client is not None:
            try:
                if self._is_sender:
                    from afd_ctl.v1 import afd_pb2

                    self.step_id += 1
                    client.publish(afd_pb2.AFDControlPayload(step_id=self.step_id, stop=True))
                    client.flush(timeout_s=5.0)
                    log.info("afd attention %s: sent stop at step %d", self.worker_id, self.step_id)
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd attention %s: stop not delivered: %s", self.worker_id, exc)
            client.close()
        if exchange is not None:
            try:
                exchange.close()
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd attention %s: data plane close: %s", self.worker_id, exc)

    # -- per step ---------------------------------------------------------------------------
    def begin_step(self, ctx: Any, num_tokens: int | None, flags: StepFlags) -> None:
        """`num_tokens`: rows this rank's model runs now (padded); `ctx`: vLLM's forward context.

        Raises AfdStepFailed when the FFN side cannot serve this step (lost, not yet back):
        the engine fails the step's requests and stays up (vllm_ext.step_failures)."""
        if self._exchange is None or self._client is None:
            raise RuntimeError("afd: attention session is closed")
        counts = self._counts(ctx, num_tokens)
        self.step_id += 1
        shape = StepShape(step_id=self.step_id, stages={0: counts})
        self._shape = None
        with _step_failures(self.step_id):
            self._ensure_connected()
            # Data-plane state first (buffers for this step), then the control message.
            self._exchange.begin_step(shape)
            self._shape = shape
            if self._is_sender:
                payload = make_payload(
                    self.step_id,
                    shape.stages,
                    is_warmup=flags.is_warmup,
                    is_profile=flags.is_profile,
                    is_graph_capturing=flags.is_graph_capturing,
                    is_graph_replaying=flags.is_graph_replaying,
                )
                self._client.publish(payload)
        if self._profiler is not None:
            self._profiler.step(self.step_id)

    def _ensure_connected(self) -> None:
        """Before a step: if the data plane lost a peer or afd-ctl moved to a newer epoch,
        reconnect to the newest complete view, waiting at most RECONNECT_WAIT_S for it."""
        assert self._exchange is not None and self._client is not None
        transport = self._exchange.transport
        view = self._client.view
        if transport.lost is None and view.complete and view.epoch == transport.epoch:
            return
        try:
            view = self._client.wait_complete(
                timeout_s=min(RECONNECT_WAIT_S, self.afd.step_timeout_s),
                after_epoch=transport.epoch or 0,
            )
        except AfdTimeout:
            why = transport.lost or "the FFN side is not complete"
            raise AfdNotReady(
                f"no complete FFN side to run on ({why}); afd-ctl at {self.afd.controller} "
                "has not seen the FFN servers come back. Start them again; /health is 503 "
                "until then"
            ) from None
        self._exchange.connect(view)
        log.warning(
            "afd attention %s: reconnected to %d ffn peer(s) at epoch %d",
            self.worker_id,
            len(view.peers),
            view.epoch,
        )

    def _counts(self, ctx: Any, num_tokens: int | None) -> list[int]:
        dp = getattr(ctx, "dp_metadata", None) if ctx is not None else None
        if dp is not None and self.dp_size > 1:
            return [int(n) for n in dp.num_tokens_across_dp_cpu.tolist()]
        if self.dp_size > 1:
            raise RuntimeError(
                "afd: attention DP > 1 but the forward context has no DPMetadata "
                "(num_tokens_across_dp); cannot tell the FFN side the token counts"
            )
        if num_tokens is None:
            raise RuntimeError("afd: model forward without positions; cannot size the step")
        return [num_tokens]

    def exchange(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        exchange, shape = self._exchange, self._shape
        if exchange is None or shape is None:
            raise RuntimeError("afd: FFN exchange outside a step")
        with _step_failures(shape.step_id, layer_idx):
            return exchange.exchange(layer_idx, 0, hidden_states)

    def end_step(self) -> None:
        if self._exchange is not None and self._shape is not None:
            self._exchange.end_step()
        self._shape = None


@contextlib.contextmanager
def _step_failures(step_id: int, layer: int | None = None) -> Iterator[None]:
    """AFD errors of a step become AfdStepFailed, which fails the step's requests only."""
    try:
        yield
    except (AfdError, AfdDataError) as exc:
        where = f"step {step_id}" + (f", layer {layer}" if layer is not None else "")
        raise AfdStepFailed(f"{where}: {exc}") from exc


class _StepProfiler:
    """torch.profiler over steps [start, start + steps), one trace file per role and window."""

    def __init__(self, afd: AfdConfig, name: str) -> None:
        self.afd = afd
        self.name = name
        self._prof: Any = None
        self._done = False

    def step(self, step_id: int) -> None:
        start, stop = (
            self.afd.profile_start_step,
            self.afd.profile_start_step + self.afd.profile_steps,
        )
        if self._done:
            return
        if step_id == start and self._prof is None:
            os.makedirs(self.afd.profile_dir, exist_ok=True)
            self._prof = torch.profiler.profile(record_shapes=False)
            self._prof.__enter__()
        elif self._prof is not None:
            self._prof.step()
            if step_id >= stop:
                self._prof.__exit__(None, None, None)
                path = os.path.join(self.afd.profile_dir, f"afd-{self.name}-{os.getpid()}.json")
                self._prof.export_chrome_trace(path)
                log.info("afd: wrote torch profiler trace %s (steps %d..%d)", path, start, stop - 1)
                self._prof, self._done = None, True
