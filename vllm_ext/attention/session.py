"""One attention worker's AFD session: its link to afd-ctl (registration, views, reconnects,
stop), its data plane and exchange (vllm_ext.exchange), and the step state machine the runner
drives (`steps`, vllm_ext.attention.steps), to which it is the `StepLink`. Waits are bounded."""

from __future__ import annotations

import atexit
import json
import logging
import threading
from typing import Any

import torch

from afd_ctl.errors import AfdNotReady, AfdTimeout
from afd_ctl.routing import Role
from afd_ctl.step import Step
from afd_ctl.v1 import afd_pb2
from vllm_ext import model_split
from vllm_ext.attention.fence import ScaleFence
from vllm_ext.attention.place import AttentionPlace, worker_id_of
from vllm_ext.attention.step_failures import failure_reason
from vllm_ext.attention.steps import AttentionSteps, RankShape, Steps
from vllm_ext.attention.tp_group import FollowerSteps
from vllm_ext.config import AfdConfig
from vllm_ext.control import ControlAccess
from vllm_ext.exchange.base import AttentionExchange
from vllm_ext.exchange.data_plane import DataPlane
from vllm_ext.exchange.factory import Exchanges, attention_exchanges
from vllm_ext.metrics import AttentionMetrics, worker_files
from vllm_ext.peer_link import PeerLink, elastic_spec, expected_counts
from vllm_ext.step_profiler import StepProfiler

log = logging.getLogger(__name__)

# Before a step after a loss: how long to wait for afd-ctl's next complete view (it may be on
# its way); past that the step fails at once, so requests do not queue behind a dead FFN side.
RECONNECT_WAIT_S = 1.0


class AttentionSession:
    def __init__(self, vllm_config: Any, afd: AfdConfig) -> None:
        parallel = vllm_config.parallel_config
        self.vllm_config = vllm_config
        self.afd = afd
        self.dp_rank: int = parallel.data_parallel_rank
        self.dp_size: int = parallel.data_parallel_size
        self.tp_size: int = parallel.tensor_parallel_size
        # Attention TP: TP rank 0 is the group's attention role rank (its dp_rank) and exchanges
        # for the group; the others take its FFN outputs (vllm_ext.attention.tp_group).
        self.tp_rank: int = _tp_rank() if self.tp_size > 1 else 0
        self.leader = self.tp_rank == 0
        # One server of DP size D holds attention ranks 0..D-1; a server of DP size 1 may be
        # one of several, at its afd attention_rank (vllm_ext.attention.place).
        self.role_rank = afd.attention_rank + self.dp_rank
        self.place: AttentionPlace | None = None  # once afd-ctl said how many ranks it routes
        self.worker_id = worker_id_of(
            afd.worker_id, self.role_rank, self.dp_size, self.tp_rank, self.tp_size
        )
        hf = vllm_config.model_config.hf_config
        self.num_layers: int = hf.num_hidden_layers
        self.hidden_size: int = hf.hidden_size
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self._loss_watch: Any = None  # afd_data.rendezvous.StuckLossWatch, once started
        self._link: PeerLink[AttentionExchange] | None = None
        self.client: Any = None  # self._link.client
        self.exchanges: Exchanges[AttentionExchange] | None = None
        self.is_sender = False
        self._lock = threading.Lock()
        self.profiler: Any = None
        self.metrics = AttentionMetrics(None)
        # The step state machine (vllm_ext.attention.steps): the runner drives it.
        self.steps: Steps
        if self.leader:
            shape = RankShape(
                self.worker_id,
                self.dp_rank,
                self.dp_size,
                self.num_layers,
                self.hidden_size,
                self.dtype,
                recoverable=self.tp_size == 1,
            )
            self._steps: AttentionSteps | None = AttentionSteps(self, shape)
            self.steps = self._steps
        else:
            self._steps = None
            self.steps = FollowerSteps()
        self._full_graphs: bool | None = None  # a TP follower's: its leader's (set_full_graphs)
        self._fence: ScaleFence | None = None  # follows afd-ctl scale (issue 37)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        from afd_ctl.client import WorkerSpec

        afd = self.afd
        if not self.leader:
            log.info(
                "afd attention %s: TP rank %d of %d takes its FFN outputs from TP rank 0, "
                "which exchanges for the group",
                self.worker_id,
                self.tp_rank,
                self.tp_size,
            )
            return
        # An engine that ends without shutting its workers down (vLLM 0.26's in-process LLM
        # has no finalizer for that) still sends stop, so the FFN servers exit cleanly.
        atexit.register(self.close)
        model_config = self.vllm_config.model_config
        max_tokens = afd.max_tokens or self.vllm_config.scheduler_config.max_num_batched_tokens
        access = ControlAccess.of(afd)
        num_attention, num_ffn, ffn_groups = expected_counts(
            access, afd.connect_timeout_s, attention_rank=afd.attention_rank
        )
        if afd.elastic and self.dp_size > 1:
            raise ValueError(
                f"afd max_attention / max_ffn (following afd-ctl scale) need data parallel size "
                f"1, this server has {self.dp_size} (its DP ranks would hold in different steps)"
                "; leave them unset (a fixed membership)"
            )
        self.place = AttentionPlace.of(
            afd.attention_rank, self.dp_size, self.tp_size, num_attention
        )
        plane = DataPlane(
            Role.ATTENTION,
            name=self.worker_id,
            rank=self.role_rank,
            dtype=model_config.dtype,
            num_attention=num_attention,
            num_ffn=num_ffn,
            ffn_groups=ffn_groups,
            hidden_size=model_config.hf_config.hidden_size,
            num_layers=self.num_layers,
            max_tokens=max_tokens,
            timeout_s=afd.step_timeout_s,
            warmup_timeout_s=afd.warmup_timeout_s,
            router=model_split.router_columns(model_config.hf_config, model_config.dtype, afd.gate),
            # Two micro-batches per step under vLLM's dual-batch overlap; else the default
            # (AFD_DATA_NUM_STAGES, 1).
            num_stages=2 if self.vllm_config.parallel_config.enable_dbo else None,
            capacity=(afd.max_attention, afd.max_ffn),
        )
        self.exchanges = attention_exchanges(plane)
        spec = WorkerSpec(
            worker_id=self.worker_id,
            role=Role.ATTENTION,
            dp_rank=self.role_rank,
            dp_size=self.place.registered_size(),
            lockstep_size=self.place.lockstep_size,
        )
        spec = elastic_spec(spec, plane, afd.elastic)  # sized for more: it follows a scale
        self._link = PeerLink(
            access, spec, self.exchanges, f"attention rank {self.role_rank}", self.vllm_config
        )
        self.client, self._loss_watch = self._link.client, self._link.loss_watch
        if afd.elastic:
            self._fence = ScaleFence(self.client, self.worker_id, afd.connect_timeout_s)
        registered = self._link.register(timeout_s=afd.connect_timeout_s)
        view = self.client.wait_complete(timeout_s=afd.connect_timeout_s)
        # The view's (a worker that joined a planned change registered before it was routed).
        self.is_sender = self.client.is_sender
        if registered.worker.role_rank != self.role_rank:
            raise RuntimeError(
                f"afd-ctl assigned attention rank {registered.worker.role_rank}, the data plane "
                f"was built for rank {self.role_rank}"
            )
        self.metrics = AttentionMetrics(worker_files())
        self.exchanges.reporting.metrics = self.metrics
        self._link.connect(view)
        self.metrics.connected(view.epoch, reconnect=False, gpu_driven=self.exchanges.gpu_driven)
        log.info(
            "afd attention %s: rank %d of %d, epoch %d, %d ffn peer(s), sender=%s, %s",
            self.worker_id,
            registered.worker.role_rank,
            view.expected_attention,
            view.epoch,
            len(view.peers),
            self.is_sender,
            afd.describe(),
        )
        if afd.profile_dir:
            self.profiler = StepProfiler(afd, f"attention-{self.role_rank}")

    @property
    def full_graphs(self) -> bool:
        """FULL CUDA graphs can hold the exchange the data plane chose at connect (a TP
        follower's: its leader's, once set_full_graphs said it)."""
        if self._link is not None and self._link.exchange is not None:
            return self._link.exchange.full_graphs
        return bool(self._full_graphs)

    def set_full_graphs(self, full_graphs: bool) -> None:
        self._full_graphs = full_graphs

    def stats(self) -> dict[str, float]:
        """The exchange's split on this rank, AFD's host time per step, payloads per message."""
        exchange = self._link.exchange if self._link is not None else None
        sent = self.client.publisher.sent.stats() if self.client is not None else {}
        return {**(exchange.stats() if exchange else {}), **self.steps.host_time.stats(), **sent}

    # -- the step machine's link (vllm_ext.attention.steps.StepLink) ---------------------------
    def exchange_for_step(self) -> AttentionExchange:
        if self._link is None or self.client is None:
            raise RuntimeError("afd: attention session is closed")
        # Steps in flight failed: this one fails now, unless afd-ctl already has a newer
        # complete view: then the reconnect (its drain forgets the old epoch's failures) comes
        # first. (A failure kept until the next request, after the FFN side came back and
        # /health said 200, failed that request on the GPU check, 2026-12-07.)
        if self._link.exchange is not None and not self._link.newer_view_known():
            self._link.exchange.raise_failure()
        self.ensure_connected()
        assert self._link.exchange is not None
        return self._link.exchange

    def across_attention(self, server_counts: list[int]) -> list[int]:
        assert self.place is not None
        return self.place.counts(server_counts)

    def publish(self, step: Step) -> None:
        if self.is_sender and self._link is not None:
            self._link.publish(step, self.steps.host_time.add)
            if self._fence is not None:
                self._fence.published(step.step_id)

    def step_opened(self, step_id: int) -> None:
        if self.profiler is not None:
            self.profiler.step(step_id)

    def step_closed(self) -> None:
        self.metrics.flush()
        if self._fence is not None:
            self._fence.step_closed()

    def say_drained(self) -> bool:
        """Tells afd-ctl this leaving server is drained (False: afd-ctl is not asking)."""
        client = self.client
        if client is None or not client.leaving:
            return False
        client.drained("the API server finished its requests and takes no new ones")
        log.info("afd attention %s: drained for a planned change", self.worker_id)
        return True

    def close(self) -> None:
        """Publishes stop (sender only, and not once retired: the others serve on), then
        leaves the daemon; idempotent."""
        atexit.unregister(self.close)
        with self._lock:
            client, self.client = self.client, None
            exchanges, self.exchanges = self.exchanges, None
        if client is not None:
            flags = json.dumps(self.steps.flag_counts)
            log.info("afd attention %s: afd attention flags %s", self.worker_id, flags)
            try:
                if self.is_sender and self._steps is not None and not client.retired:
                    step_id = self._steps.next_step_id()
                    client.publish(afd_pb2.AFDControlPayload(step_id=step_id, stop=True))
                    client.flush(timeout_s=5.0)
                    log.info("afd attention %s: sent stop at step %d", self.worker_id, step_id)
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd attention %s: stop not delivered: %s", self.worker_id, exc)
            assert self._link is not None  # set whenever the client is
            self._link.close("attention server shutting down")  # its direct socket too
        if exchanges is not None:
            try:
                exchanges.close()
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd attention %s: data plane close: %s", self.worker_id, exc)

    def ensure_connected(self) -> None:
        """Before a step: if the data plane lost a peer or afd-ctl moved to a newer epoch,
        reconnect to the newest complete view, waiting at most RECONNECT_WAIT_S for it.

        A loss only this data plane saw (afd-ctl still has everyone alive in the same epoch,
        so no newer view would ever come) makes this worker rejoin afd-ctl once it has lasted
        `rejoin_after_s` (afd_data.rendezvous.StuckLossWatch)."""
        assert self.client is not None and self._loss_watch is not None
        assert self._link is not None and self.exchanges is not None
        transport = self._link.plane.transport
        if self._fence is not None:
            self._follow(self._fence.before_step())
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
        self.client.discard_rejections()  # refusals of payloads from before the reconnect
        self._link.connect(view)
        assert self.place is not None
        self.place.num_attention = view.expected_attention
        self.metrics.connected(view.epoch, reconnect=True, gpu_driven=self.exchanges.gpu_driven)
        log.warning(
            "afd attention %s: reconnected to %d ffn peer(s) at epoch %d",
            self.worker_id,
            len(view.peers),
            view.epoch,
        )

    def _follow(self, view: Any) -> None:
        """After a hold (vllm_ext.attention.fence; None: none now, it may have been lifted
        since the last step fenced): reconnect to the epoch `afd-ctl scale` moved to (its peers
        and routing). An aborted change or a loss: the usual path of ensure_connected."""
        assert self._link is not None and self.exchanges is not None
        if view is None and self._link.plane.transport.lost is None:
            view = self.client.view
        if view is None or view.epoch <= self._link.transport_epoch or not view.complete:
            return
        self._link.connect(view)
        self.is_sender = self.client.is_sender
        if self.place is not None:
            self.place.num_attention = view.expected_attention
        self.metrics.connected(view.epoch, reconnect=True, gpu_driven=self.exchanges.gpu_driven)
        log.info(
            "afd attention %s: followed afd-ctl scale to %d:%d at epoch %d, %d ffn peer(s)",
            self.worker_id,
            view.expected_attention,
            view.expected_ffn,
            view.epoch,
            len(view.peers),
        )

    def failed(self, exc: BaseException) -> None:
        """Counts a failed step by reason (afd_failed_steps_total)."""
        lost = self._loss_watch is not None and self._loss_watch.controller_lost
        self.metrics.failed_step(failure_reason(exc, controller_lost=lost))


def _tp_rank() -> int:
    from vllm_ext import compat

    return compat.seams().tensor_parallel_rank()
