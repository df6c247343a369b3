"""One attention worker's AFD state: its afd-ctl session, its data plane, its step counter.

Per step: `open_step` (as soon as vLLM has decided the step's padding) sizes the data plane for
the step's token counts, then (on a designated sender) publishes the AFDControlPayload; the
model forward checks it runs that step (`check_forward`); each proxy layer calls `exchange`;
then `end_step`. Every wait is bounded by `step_timeout_s` and fails with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from afd_ctl.errors import AfdError, AfdNotReady, AfdTimeout
from afd_ctl.payloads import make_payload
from afd_ctl.routing import Role
from afd_data.errors import AfdBadInput, AfdDataError
from vllm_ext import model_split
from vllm_ext.config import AfdConfig
from vllm_ext.control import ControlAccess
from vllm_ext.exchange import AttentionExchange, StepShape
from vllm_ext.metrics import AttentionMetrics, worker_files
from vllm_ext.peer_link import PeerLink, expected_counts
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

    @property
    def warmup(self) -> bool:
        """Compile or capture may run inside this step: waits get afd warmup_timeout_s."""
        return self.is_warmup or self.is_profile or self.is_graph_capturing


class AttentionSession:
    def __init__(self, vllm_config: Any, afd: AfdConfig) -> None:
        parallel = vllm_config.parallel_config
        self.vllm_config = vllm_config
        self.afd = afd
        self.dp_rank: int = parallel.data_parallel_rank
        self.dp_size: int = parallel.data_parallel_size
        self.tp_size: int = parallel.tensor_parallel_size
        # Attention TP: every TP rank is its own attention role rank (dp_rank * tp + tp_rank)
        # and exchanges its (replicated) rows itself, so no broadcast inside the TP group.
        self.tp_rank: int = _tp_rank() if self.tp_size > 1 else 0
        self.worker_id = _worker_id(afd.worker_id, self.dp_rank, self.dp_size, self.tp_rank,
                                    self.tp_size)  # fmt: skip
        self.step_id = 0
        # The open step captures CUDA graphs: the graph pieces before each exchange were only
        # recorded, not run, so their outputs are uninitialised memory; zeros go out instead.
        self._capturing = False
        # Steps published per CUDA-graph flag (logged at close as "afd attention flags").
        self.flag_counts = {"capture_steps": 0, "replay_steps": 0, "eager_steps": 0}
        self._capture_keys: set[tuple[int, ...]] = set()
        hf = vllm_config.model_config.hf_config
        self.num_layers: int = hf.num_hidden_layers
        self.hidden_size: int = hf.hidden_size
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        # The open step: its shape, this rank's rows per stage (micro-batch), how many layers
        # each stage exchanged, and how many stage forwards have not ended yet.
        self._shape: StepShape | None = None
        self._stage_rows: list[int] = []
        self._layers_done: list[int] = []
        self._forwards_left = 0
        # An AFD failure inside a micro-batch's thread (vLLM's dual-batch overlap does not
        # carry a thread's exception out): raised on the runner's own thread after the forward.
        self._stage_failure: BaseException | None = None
        # The open step is a FULL-graph capture: its exchanges are recorded, not run.
        self._recorded = False
        # (stage, hand-over) of the running micro-batch; vLLM's ubatching through compat.
        self.micro_batch: Callable[[], tuple[int, Callable[[], None]]] = _micro_batch
        self._loss_watch: Any = None  # afd_data.rendezvous.StuckLossWatch, once started
        self._link: PeerLink | None = None
        self._client: Any = None  # self._link.client
        self._exchange: AttentionExchange | None = None
        self._is_sender = False
        self._lock = threading.Lock()
        self._profiler: Any = None
        self._metrics = AttentionMetrics(None)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        from afd_ctl.client import WorkerSpec

        afd = self.afd
        # An engine that ends without shutting its workers down (vLLM 0.26's in-process LLM
        # has no finalizer for that) still sends stop, so the FFN servers exit cleanly.
        atexit.register(self.close)
        model_config = self.vllm_config.model_config
        max_tokens = afd.max_tokens or self.vllm_config.scheduler_config.max_num_batched_tokens
        access = ControlAccess.of(afd)
        num_attention, num_ffn = expected_counts(access, afd.connect_timeout_s)
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
            warmup_timeout_s=afd.warmup_timeout_s,
            router=model_split.router_columns(model_config.hf_config, model_config.dtype, afd.gate),
            attention_tp_size=self.tp_size,
            # Two micro-batches per step under vLLM's dual-batch overlap; else the default
            # (AFD_DATA_NUM_STAGES, 1).
            num_stages=2 if self.vllm_config.parallel_config.enable_dbo else None,
        )
        spec = WorkerSpec(
            worker_id=self.worker_id,
            role=Role.ATTENTION,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        self._link = PeerLink(
            access, spec, self._exchange, f"attention rank {self.role_rank}", self.vllm_config
        )
        self._client, self._loss_watch = self._link.client, self._link.loss_watch
        registered = self._link.register(timeout_s=afd.connect_timeout_s)
        view = self._client.wait_complete(timeout_s=afd.connect_timeout_s)
        self._is_sender = registered.is_sender
        if registered.worker.role_rank != self.role_rank:
            raise RuntimeError(
                f"afd-ctl assigned attention rank {registered.worker.role_rank}, the data plane "
                f"was built for rank {self.role_rank}"
            )
        self._link.connect(view)
        self._metrics = AttentionMetrics(worker_files())
        self._exchange.metrics = self._metrics
        self._metrics.connected(
            view.epoch, reconnect=False, gpu_driven=self._exchange.path == "gpu"
        )
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

    @property
    def exchange_path(self) -> str:
        """ "gpu" or "nixl": the path the data plane chose at connect."""
        return self._exchange.path if self._exchange is not None else "nixl"

    def stats(self) -> dict[str, float]:
        """The data plane's per-layer split on this rank (see AttentionExchange.stats)."""
        return self._exchange.stats() if self._exchange is not None else {}

    def close(self) -> None:
        """Publishes stop (sender only), then leaves the daemon; idempotent."""
        atexit.unregister(self.close)
        with self._lock:
            client, self._client = self._client, None
            exchange, self._exchange = self._exchange, None
        model_split.set_exchange(None)
        if client is not None:
            log.info("afd attention %s: afd attention flags %s", self.worker_id,
                     json.dumps(self.flag_counts))  # fmt: skip
            try:
                if self._is_sender:
                    from afd_ctl.v1 import afd_pb2

                    self.step_id += 1
                    client.publish(afd_pb2.AFDControlPayload(step_id=self.step_id, stop=True))
                    client.flush(timeout_s=5.0)
                    log.info("afd attention %s: sent stop at step %d", self.worker_id, self.step_id)
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd attention %s: stop not delivered: %s", self.worker_id, exc)
            client.close(reason="attention server shutting down")
        if exchange is not None:
            try:
                exchange.close()
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd attention %s: data plane close: %s", self.worker_id, exc)

    # -- per step ---------------------------------------------------------------------------
    def open_step(
        self,
        num_tokens: int,
        across_dp: list[int] | None,
        flags: StepFlags,
        stage_tokens: list[int] | None = None,
        full_graph: bool = False,
    ) -> None:
        """Opens a step as soon as its token counts are known: sizes the data plane, then (on a
        designated sender) publishes the AFDControlPayload. The runner calls it right after
        vLLM decided the step's padding, so the control hop overlaps with input preparation and
        the first attention layer instead of delaying the FFN side.

        `num_tokens`: rows this rank's model runs (padded); `across_dp`: every DP rank's.
        `stage_tokens`: under dual-batch overlap, each micro-batch's rows (padded); vLLM pads
        micro-batches alike on every DP rank, so every rank's count per stage is the same.
        Raises AfdStepFailed when the FFN side cannot serve this step (lost, not yet back):
        the engine fails the step's requests and stays up (vllm_ext.step_failures).

        `full_graph`: vLLM runs this step as a FULL CUDA graph. Capturing one records the
        GPU-driven exchange without running it, so such a step is not published (the FFN
        side has nothing to serve; it captures its own graphs when the replays come)."""
        if self._exchange is None or self._client is None:
            raise RuntimeError("afd: attention session is closed")
        if self._shape is not None:
            self._finish_abandoned_step()
        counts = self._counts(num_tokens, across_dp)
        stage_rows = list(stage_tokens) if stage_tokens else [num_tokens]
        if len(stage_rows) > 2:
            raise RuntimeError(
                f"afd: {len(stage_rows)} micro-batches in one step; the data plane carries 2"
            )
        stages = (
            {s: [rows] * len(counts) for s, rows in enumerate(stage_rows)}
            if stage_tokens
            else {0: counts}
        )
        self.step_id += 1
        shape = StepShape(step_id=self.step_id, stages=stages, warmup=flags.warmup)
        with _step_failures(self.step_id, recoverable=self.tp_size == 1, on_failure=self._failed):
            self._ensure_connected()
            # Data-plane state first (buffers for this step), then the control message; the
            # step counts as open (see _finish_abandoned_step) only once it is published.
            self._exchange.begin_step(shape)
            self._recorded = full_graph and flags.is_graph_capturing
            if self._recorded and self._exchange.path != "gpu":
                raise RuntimeError(
                    "afd: vLLM captures a FULL CUDA graph but the exchange is host-driven "
                    "(NIXL): it would be captured once and never run; vllm_ext bug"
                )
            if self._is_sender and not self._recorded:
                payload = make_payload(
                    self.step_id,
                    shape.stages,
                    is_warmup=flags.is_warmup,
                    is_profile=flags.is_profile,
                    is_graph_capturing=flags.is_graph_capturing,
                    is_graph_replaying=flags.is_graph_replaying,
                )
                self._client.publish(payload)
            self._shape, self._stage_rows = shape, stage_rows
            self._layers_done = [0] * len(stage_rows)
            self._forwards_left = len(stage_rows)
            self._stage_failure = None
            self._capturing = flags.is_graph_capturing
            self._count_flags(flags, counts, recorded=self._recorded)
        if self._profiler is not None:
            self._profiler.step(self.step_id)

    def _count_flags(self, flags: StepFlags, counts: list[int], recorded: bool = False) -> None:
        """Steps published per flag: the FFN side must capture and replay exactly these. A
        FULL-graph capture is not published (it runs nothing): counted apart."""
        if recorded:
            self.flag_counts["full_graph_captures"] = (
                self.flag_counts.get("full_graph_captures", 0) + 1
            )
        elif flags.is_graph_capturing:
            self.flag_counts["capture_steps"] += 1
            self._capture_keys.add(tuple(counts))
        elif flags.is_graph_replaying:
            self.flag_counts["replay_steps"] += 1
        else:
            self.flag_counts["eager_steps"] += 1
        self.flag_counts["capture_keys"] = len(self._capture_keys)

    def check_forward(self, num_tokens: int) -> None:
        """At the model forward (each micro-batch's, under dual-batch overlap): the open step
        must be for exactly these rows."""
        if self._shape is None:
            raise RuntimeError(
                "afd: a model forward without an open AFD step (vLLM ran the model without "
                "deciding its batch padding first); vllm_ext needs updating for this vLLM"
            )
        stage, _ = self.micro_batch()
        expected = self._stage_rows[stage] if stage < len(self._stage_rows) else None
        if num_tokens != expected:
            raise RuntimeError(
                f"afd: step {self.step_id}: micro-batch {stage} runs {num_tokens} rows but the "
                f"step was published for {self._stage_rows}; vllm_ext needs updating for this "
                "vLLM"
            )

    def _finish_abandoned_step(self) -> None:
        """A step was published but its forward did not run every layer (it raised): the FFN
        side waits for the rest, so send zeros for the remaining layers of every stage, in the
        order the FFN side takes them (layer by layer, stage 0 first), and drop the outputs."""
        assert self._shape is not None and self._exchange is not None
        step_id = self._shape.step_id
        log.warning(
            "afd attention %s: step %d ended after %s of %d layers per stage; completing it "
            "with zeros",
            self.worker_id,
            step_id,
            self._layers_done,
            self.num_layers,
        )
        device = self._exchange.transport.device if self._exchange.path == "gpu" else "cpu"
        zeros = [
            torch.zeros(rows, self.hidden_size, dtype=self.dtype, device=device)
            for rows in self._stage_rows
        ]
        try:
            with _step_failures(step_id):
                if self._exchange.path == "gpu":
                    self._shape = None
                    if self._recorded:
                        return
                    for layer in range(min(self._layers_done), self.num_layers):
                        for stage, done in enumerate(self._layers_done):
                            if done <= layer:
                                out = torch.empty_like(zeros[stage])
                                self._exchange.exchange_into(layer, stage, zeros[stage], None, out)
                    self._exchange.end_step_gpu()
                    return
                for layer in range(min(self._layers_done), self.num_layers):
                    todo = [s for s, done in enumerate(self._layers_done) if done <= layer]
                    for stage in todo:
                        self._exchange.send(layer, stage, zeros[stage])
                    for stage in todo:
                        self._exchange.recv(layer, stage, zeros[stage])
                self._exchange.end_step()
        except AfdStepFailed as exc:  # the next step reconnects if the FFN side is gone
            log.warning("afd attention %s: %s", self.worker_id, exc)
        self._shape = None

    def _ensure_connected(self) -> None:
        """Before a step: if the data plane lost a peer or afd-ctl moved to a newer epoch,
        reconnect to the newest complete view, waiting at most RECONNECT_WAIT_S for it.

        A loss only this data plane saw (afd-ctl still has everyone alive in the same epoch,
        so no newer view would ever come) makes this worker rejoin afd-ctl once it has lasted
        `rejoin_after_s` (afd_data.rendezvous.StuckLossWatch)."""
        assert self._exchange is not None and self._client is not None
        assert self._loss_watch is not None
        assert self._link is not None
        transport = self._exchange.transport
        if self._link.in_step():
            self._loss_watch.reset()
            return
        only_here = self._loss_watch.check()
        try:
            view = self._link.wait_newer(timeout_s=min(RECONNECT_WAIT_S, self.afd.step_timeout_s))
        except AfdTimeout:
            if self._loss_watch.controller_lost:
                raise AfdNotReady(
                    f"afd-ctl at {self.afd.controller} is unreachable; the workers register "
                    "again by themselves once it is back (restart it if it died); /health is "
                    "503 until then"
                ) from None
            if only_here:
                raise AfdNotReady(
                    f"the data plane lost its FFN peer ({transport.lost}) while afd-ctl at "
                    f"{self.afd.controller} still sees every worker; rejoining afd-ctl in a new "
                    "epoch to recover"
                ) from None
            why = transport.lost or "the FFN side is not complete"
            raise AfdNotReady(
                f"no complete FFN side to run on ({why}); afd-ctl at {self.afd.controller} "
                "has not seen the FFN servers come back. Start them again; /health is 503 "
                "until then"
            ) from None
        self._client.discard_rejections()  # refusals of payloads from before the reconnect
        self._link.connect(view)
        self._metrics.connected(view.epoch, reconnect=True, gpu_driven=self._exchange.path == "gpu")
        log.warning(
            "afd attention %s: reconnected to %d ffn peer(s) at epoch %d",
            self.worker_id,
            len(view.peers),
            view.epoch,
        )

    def _counts(self, num_tokens: int, across_dp: list[int] | None) -> list[int]:
        if self.dp_size == 1:
            return [num_tokens]
        if across_dp is None or len(across_dp) != self.dp_size:
            raise RuntimeError(
                f"afd: attention DP {self.dp_size} but vLLM gave no per-rank token counts "
                f"({across_dp!r}); cannot tell the FFN side the token counts"
            )
        if across_dp[self.dp_rank] != num_tokens:
            raise RuntimeError(
                f"afd: DP rank {self.dp_rank} runs {num_tokens} rows but vLLM's per-rank "
                f"counts say {across_dp}"
            )
        return across_dp

    def exchange(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's FFN round trip for the running micro-batch, into `output` (allocated
        when None) and returned. Under dual-batch overlap the rows go out, the other
        micro-batch runs (its attention computes while the FFN side computes these rows) until
        it yields back, then the output is taken. On the GPU path the round trip is only
        enqueued on the stream (or captured into vLLM's FULL graph); end_step waits for it."""
        exchange, shape = self._exchange, self._shape
        if exchange is None or shape is None:
            raise RuntimeError("afd: FFN exchange outside a step")
        if output is None:
            output = torch.empty_like(hidden_states)
        if self._capturing and not torch.cuda.is_current_stream_capturing():
            # Piecewise capture: the pieces before this op were recorded, not run.
            hidden_states = torch.zeros_like(hidden_states)
            router_logits = None if router_logits is None else torch.zeros_like(router_logits)
        stage, hand_over = self.micro_batch()
        overlapped = len(self._stage_rows) > 1
        if overlapped and self._stage_failure is not None:
            hand_over()  # the step failed in a micro-batch: keep the hand-overs paired
            return output.zero_()
        handed_over = False
        try:
            with _step_failures(
                shape.step_id, layer_idx, recoverable=self.tp_size == 1, on_failure=self._failed
            ):
                if exchange.path == "gpu":
                    exchange.exchange_into(layer_idx, stage, hidden_states, router_logits, output)
                    if overlapped:
                        handed_over = True
                        hand_over()
                    out = output
                elif not overlapped:
                    exchange.exchange_into(layer_idx, stage, hidden_states, router_logits, output)
                    out = output
                else:
                    exchange.send(layer_idx, stage, hidden_states, router_logits)
                    handed_over = True
                    hand_over()
                    out = output.copy_(exchange.recv(layer_idx, stage, hidden_states))
        except Exception as exc:
            if not overlapped:
                raise
            # A micro-batch's thread cannot fail the step itself (vLLM does not carry its
            # exception out): the runner raises it after the forward (raise_stage_failure).
            # Zeros let this micro-batch finish so the other one is not left waiting.
            self._stage_failure = exc
            if not handed_over:
                hand_over()
            return output.zero_()
        self._layers_done[stage] = layer_idx + 1
        return out

    def raise_stage_failure(self) -> None:
        """On the runner's thread after the model forward: a micro-batch's failure fails the
        step here (see exchange)."""
        failure, self._stage_failure = self._stage_failure, None
        if failure is not None:
            raise failure

    def end_step(self) -> None:
        """After the model forward; under dual-batch overlap after each micro-batch's, and the
        step ends with the last."""
        self._forwards_left -= 1
        if self._forwards_left > 0:
            return
        if self._stage_failure is not None:
            return  # the step is abandoned: the next open_step completes it
        if self._exchange is not None and self._shape is not None:
            shape, self._shape = self._shape, None
            with _step_failures(
                shape.step_id, recoverable=self.tp_size == 1, on_failure=self._failed
            ):
                if self._exchange.path == "gpu":
                    if not self._recorded:
                        self._exchange.end_step_gpu()
                else:
                    self._exchange.end_step()
            self._metrics.flush()
        self._shape = None

    def finish_forward(self) -> None:
        """After vLLM's model call returned (runner side): a step still open here ran as a
        replayed FULL CUDA graph, which runs no forward hooks; it ends now."""
        if self._shape is not None and self._stage_failure is None:
            self._forwards_left = 1
            self.end_step()

    def _failed(self, exc: BaseException) -> None:
        """Counts a failed step by reason (afd_failed_steps_total)."""
        from afd_ctl.errors import AfdControllerUnreachable, AfdPeerLost, AfdRejected

        if isinstance(exc, AfdControllerUnreachable) or (
            self._loss_watch is not None and self._loss_watch.controller_lost
        ):
            reason = "controller_unreachable"
        elif isinstance(exc, AfdPeerLost):
            reason = "peer_lost"
        elif isinstance(exc, AfdNotReady):
            reason = "not_ready"
        elif isinstance(exc, AfdTimeout):
            reason = "timeout"
        elif isinstance(exc, AfdRejected):
            reason = "rejected"
        else:
            reason = "other"
        self._metrics.failed_step(reason)


def _micro_batch() -> tuple[int, Callable[[], None]]:
    from vllm_ext import compat

    return compat.seams().micro_batch()


def _tp_rank() -> int:
    from vllm_ext import compat

    return compat.seams().tensor_parallel_rank()


def _worker_id(base: str, dp_rank: int, dp_size: int, tp_rank: int, tp_size: int) -> str:
    """ "attention-dp0" by default; a given id gets -dp<r> / -tp<r> when there are several."""
    worker_id = base or f"attention-dp{dp_rank}"
    if base and dp_size > 1:
        worker_id += f"-dp{dp_rank}"
    if tp_size > 1:
        worker_id += f"-tp{tp_rank}"
    return worker_id


@contextlib.contextmanager
def _step_failures(
    step_id: int,
    layer: int | None = None,
    *,
    recoverable: bool = True,
    on_failure: Callable[[BaseException], None] | None = None,
) -> Iterator[None]:
    """AFD errors of a step become AfdStepFailed, which fails the step's requests only.

    Not `recoverable` under attention TP > 1: each TP rank would decide alone, one could leave
    the forward while the others wait in its all-reduce, so the error ends the engine."""
    try:
        yield
    except AfdBadInput as exc:  # a setting or an extension bug: every step would fail alike
        raise RuntimeError(f"afd: step {step_id}: {exc}") from exc
    except (AfdError, AfdDataError) as exc:
        if on_failure is not None:
            on_failure(exc)
        where = f"step {step_id}" + (f", layer {layer}" if layer is not None else "")
        if not recoverable:
            raise RuntimeError(
                f"afd: {where}: {exc} (attention TP > 1: its TP ranks cannot fail a step "
                "together yet, so this ends the server)"
            ) from exc
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
