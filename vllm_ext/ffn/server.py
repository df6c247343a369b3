"""The FFN role: `vllm serve MODEL --afd-role ffn --afd-controller HOST:PORT`.

No scheduler, no KV cache, no HTTP: it loads only the FFN half (vllm_ext.model_split), registers
with afd-ctl and runs one step per AFDControlPayload: for every layer and stage it receives each
attention peer's rows, runs the layer's MLP/MoE over their concatenation and writes each peer
its slice back. It exits 0 on `stop`; any error is logged at once and ends the session, so the
daemon marks the worker lost and the attention side fails fast instead of hanging.

Entry points: vllm_ext.ffn.cli (`vllm serve MODEL --afd-role ffn ...`) and `python -m vllm_ext.ffn`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from afd_ctl.errors import (
    AfdControllerUnreachable,
    AfdNotReady,
    AfdPeerLost,
    AfdStopped,
    AfdTimeout,
)
from afd_ctl.routing import Role
from vllm_ext.config import AfdConfig
from vllm_ext.control import ControlAccess
from vllm_ext.exchange.base import FfnExchange
from vllm_ext.exchange.data_plane import DataPlane
from vllm_ext.exchange.factory import Exchanges, ffn_exchanges
from vllm_ext.ffn.engine import warm_up
from vllm_ext.ffn.payloads import Payloads
from vllm_ext.ffn.stack import ExpertShard, expert_shard, serve_shard, view_shard
from vllm_ext.ffn.steps import FfnSteps
from vllm_ext.metrics import FfnMetrics, serve_ffn_metrics
from vllm_ext.model_split import router_columns
from vllm_ext.peer_link import PeerLink, elastic_spec, expected_counts
from vllm_ext.startup_errors import is_ours, one_line

log = logging.getLogger("vllm_ext.ffn.server")

# While no payload comes: the data plane is polled this often (a peer settling its transfers
# at reconnect needs this side to poll too; see NixlTransport.poll_idle).
IDLE_POLL_S = 0.05
WAIT_LOG_S = 30.0  # waiting for peers: log this often


class FfnWorker:
    """One FFN rank. `run()` returns the process exit code."""

    def __init__(self, vllm_config: Any, afd: AfdConfig) -> None:
        self.vllm_config = vllm_config
        self.afd = afd
        self.worker_id = afd.worker_id or f"ffn-{afd.ffn_rank}-{os.getpid()}"
        # The FFN half and what each payload runs: loaded in run(), once afd-ctl said which
        # slice of the experts this rank holds (vllm_ext.ffn.stack, vllm_ext.ffn.steps).
        self.engine: Any = None
        self.step_runner: FfnSteps | None = None
        self._stop = threading.Event()
        # Told to afd-ctl when this server leaves (its peers' PEER_LOST says "left: ...").
        self._leave_reason = "ffn server exiting"
        self._link: PeerLink[FfnExchange] | None = None
        self._client: Any = None  # self._link.client
        self._payloads: Payloads | None = None  # relayed and direct (afd_ctl.direct)
        self._exchanges: Exchanges[FfnExchange] | None = None
        self._loss_watch: Any = None  # afd_data.rendezvous.StuckLossWatch, once started
        self._peers: list[int] = []  # attention role ranks served, in order of concatenation
        self._profiler: Any = None
        self._said_unreachable = False
        self._metrics = FfnMetrics(None)
        self._connects = 0

    def _load(self, shard: ExpertShard) -> None:
        from vllm_ext.ffn.engine import FfnEngine

        self.engine = FfnEngine(self.vllm_config, shard)
        if self.afd.gate == "attention":
            self.engine.stack.use_given_router_logits()
        self.step_runner = FfnSteps(graphs=self.graphs, worker_id=self.worker_id)

    @property
    def graphs(self) -> bool:
        """CUDA graphs as the payloads' flags say (on GPU, unless enforce_eager)."""
        return not self.vllm_config.model_config.enforce_eager

    def request_stop(self, reason: str) -> None:
        log.info("afd ffn %s: stop requested (%s)", self.worker_id, reason)
        self._leave_reason = f"ffn server stopping ({reason})"
        self._stop.set()

    def run(self) -> int:
        from afd_ctl.client import WorkerSpec

        afd = self.afd
        hf = self.vllm_config.model_config.hf_config
        access = ControlAccess.of(afd)
        counts = expected_counts(access, afd.connect_timeout_s, ffn_rank=afd.ffn_rank)
        num_attention, num_ffn, ffn_groups = counts
        if afd.ffn_rank >= num_ffn:
            raise ValueError(
                f"afd ffn_rank {afd.ffn_rank} but afd-ctl expects {num_ffn} FFN ranks "
                "(--expect-ffn); give each FFN server a distinct ffn_rank below that"
            )
        if afd.metrics_port:
            self._metrics = serve_ffn_metrics(afd.metrics_host, afd.metrics_port)
        if afd.attention_tp_size > 1:
            log.warning(
                "afd ffn: attention_tp_size %d is not needed and is ignored: TP rank 0 "
                "of an attention server exchanges for its TP group",
                afd.attention_tp_size,
            )
        shard = expert_shard(afd.ffn_rank, num_attention, num_ffn, groups=ffn_groups)
        self._load(shard)
        plane = DataPlane(
            Role.FFN,
            name=self.worker_id,
            rank=afd.ffn_rank,
            dtype=self.vllm_config.model_config.dtype,
            num_attention=num_attention,
            num_ffn=num_ffn,
            ffn_groups=ffn_groups,
            hidden_size=hf.hidden_size,
            num_layers=self.engine.num_layers,
            max_tokens=afd.max_tokens or self.vllm_config.scheduler_config.max_num_batched_tokens,
            timeout_s=afd.step_timeout_s,
            warmup_timeout_s=afd.warmup_timeout_s,
            router=router_columns(hf, self.vllm_config.model_config.dtype, afd.gate),
            num_stages=afd.num_stages,
            capacity=(afd.max_attention, afd.max_ffn),
        )
        self._exchanges = ffn_exchanges(plane, self.engine, self.graphs)
        warm_up(self.engine, plane, self.worker_id)
        spec = WorkerSpec(self.worker_id, Role.FFN, dp_rank=afd.ffn_rank, dp_size=num_ffn)
        spec = elastic_spec(spec, plane, afd.elastic)
        self._link = PeerLink(
            access, spec, self._exchanges, f"ffn rank {afd.ffn_rank}", self.vllm_config
        )
        self._client, self._loss_watch = self._link.client, self._link.loss_watch
        self._payloads = Payloads(self._client, self._link.inbox)
        # /health follows afd-ctl too: 503 while it is unreachable or the set is incomplete,
        # whichever the loop happens to see first (an outage, a lost peer).
        self._metrics.follow(self._client.serving)
        if afd.profile_dir:
            from vllm_ext.step_profiler import StepProfiler

            self._profiler = StepProfiler(afd, Role.FFN.label)
        try:
            registered = self._link.register(timeout_s=afd.connect_timeout_s)
            log.info(
                "afd ffn %s: registered as ffn rank %d (%s); waiting for the expected set",
                self.worker_id,
                registered.worker.role_rank,
                shard,
            )
            view = self._wait_for_peers(after_epoch=0)
            if view is None:
                return 0
            self._connect(view)
            while not self._stop.is_set():
                try:
                    self._check_gpu_steps()
                    payload = self._payloads.next(IDLE_POLL_S, self._link.plane.epoch)
                    if self._follow_epoch(payload):
                        self.run_step(payload)
                    self._said_unreachable = False
                except AfdTimeout:
                    self._poll_idle()
                    continue
                except AfdStopped as exc:
                    log.info(
                        "afd ffn %s: %s; exiting after %d steps", self.worker_id, exc, self.steps
                    )
                    self._leave_reason = f"ffn server exiting: {exc}"
                    return 0
                except (AfdPeerLost, AfdNotReady) as exc:
                    # From the daemon or from the data plane (which may see a death first):
                    # wait for a newer complete view, then reconnect to its peers.
                    log.warning("afd ffn %s: %s", self.worker_id, exc)
                    self._metrics.disconnected()  # /health: 503 until connected again
                    assert self._link is not None
                    try:
                        view = self._wait_for_peers(self._link.plane.epoch)
                    except AfdStopped as stopped:
                        log.info("afd ffn %s: %s; exiting", self.worker_id, stopped)
                        return 0
                    if view is None:
                        return 0
                    self._connect(view)
                    continue
                except AfdControllerUnreachable as exc:
                    # The client re-registers by itself; say so once, not at every poll.
                    if not self._said_unreachable:
                        log.warning("afd ffn %s: %s", self.worker_id, exc)
                        self._said_unreachable = True
                    self._poll_idle()
                    time.sleep(IDLE_POLL_S)
                    continue
            return 0
        except Exception as exc:
            if self._connects == 0 and is_ours(exc):  # a start-up failure: one line (ffn.cli)
                self._leave_reason = f"ffn server could not start: {one_line(exc)}"
                raise
            log.exception(
                "afd ffn %s: failed at step %d; leaving afd-ctl", self.worker_id, self.steps
            )
            why = f"{type(exc).__name__}: {exc}"
            self._leave_reason = f"ffn server failed at step {self.steps}: {why}"
            return 1
        finally:
            self.close()

    def _poll_idle(self) -> None:
        if self._exchanges is not None:
            self._exchanges.plane.poll_idle()

    def _check_gpu_steps(self) -> None:
        """GPU-driven path: retires finished steps; one past its bound (or under a lost peer)
        raises AfdPeerLost here, in the loop that reconnects."""
        if self._link is not None and self._link.exchange is not None:
            self._link.exchange.check()

    def _follow_epoch(self, payload: Any) -> bool:
        """True when the data plane is in the payload's epoch, reconnecting it first when the
        payload is of a newer one; False for a payload to drop.

        afd-ctl may move to a new epoch without a PEER_LOST reaching this loop: after a
        restart of the daemon both workers register anew, and if this one completes the set
        its registration already brings the complete view of the new epoch. The attention
        side then publishes in that epoch, so its first payload is how the loop learns."""
        assert self._link is not None and self._client is not None
        current = self._link.plane.epoch
        if payload.epoch == current:
            return True
        step = (self.worker_id, payload.step_id, payload.epoch)  # what the lines below name
        if payload.epoch < current:
            log.info("afd ffn %s: dropped step %d of epoch %d (now at epoch %d)", *step, current)
            return False
        # The view that made the attention side publish in this epoch came before its payload
        # on the same session stream, so it is already here.
        assert self._link is not None
        try:
            view = self._link.wait_newer(timeout_s=self.afd.step_timeout_s, after_epoch=current)
        except AfdTimeout as exc:
            log.warning("afd ffn %s: dropped step %d of epoch %d: %s", *step, exc)
            return False
        if view.epoch != payload.epoch:
            log.info(
                "afd ffn %s: dropped step %d of epoch %d (afd-ctl is at epoch %d)",
                self.worker_id,
                payload.step_id,
                payload.epoch,
                view.epoch,
            )
            self._connect(view)
            return False
        log.warning(
            "afd ffn %s: step %d is of epoch %d, the data plane of epoch %d: reconnecting first",
            self.worker_id,
            payload.step_id,
            payload.epoch,
            current,
        )
        self._connect(view)
        return True

    def _wait_for_peers(self, after_epoch: int) -> Any:
        """The next complete view newer than `after_epoch`, or None once a stop is requested.

        An FFN server is a server: it waits for its attention peers as long as it runs (they
        may take many minutes to load a large model), logging every WAIT_LOG_S. After a loss
        that only the data plane saw (a wait timed out, yet afd-ctl still has everyone in the
        same epoch), it rejoins afd-ctl after `rejoin_after_s` (StuckLossWatch): the new epoch
        makes every peer drop the stuck step and reconnect, instead of all waiting for each
        other."""
        assert self._link is not None and self._loss_watch is not None
        started = time.monotonic()
        next_log = started + WAIT_LOG_S
        while not self._stop.is_set():
            try:
                view = self._link.wait_newer(timeout_s=IDLE_POLL_S, after_epoch=after_epoch)
                self._loss_watch.reset()
                return view
            except AfdTimeout:
                self._poll_idle()
                self._loss_watch.check()
                now = time.monotonic()
                if now >= next_log:
                    next_log = now + WAIT_LOG_S
                    log.info(
                        "afd ffn %s: waiting for the attention side: %s",
                        self.worker_id,
                        self._client.incomplete_message(f"for {now - started:.0f} s so far"),
                    )
        return None

    def stats(self) -> dict[str, float]:
        stats = self.step_runner.stats() if self.step_runner is not None else {}
        for part in (self._exchanges, self._payloads):  # the data plane's; the payloads' paths
            if part is not None:
                stats.update(part.stats())
        return stats

    def close(self) -> None:
        log.info("afd ffn %s: stats %s", self.worker_id, json.dumps(self.stats()))
        client, self._client = self._client, None
        exchanges, self._exchanges = self._exchanges, None
        if client is not None:
            assert self._link is not None  # set whenever the client is
            self._link.close(self._leave_reason)  # its direct socket too
        if exchanges is not None:
            try:
                exchanges.close()
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd ffn %s: data plane close: %s", self.worker_id, exc)

    def _connect(self, view: Any) -> None:
        me = self._client.role_rank
        self._peers = sorted(r.attention_rank for r in view.routes if me in r.ffn_ranks)
        assert self._link is not None
        serve_shard(self.engine.stack, view_shard(me, view))  # the experts of its new group
        self._link.connect(view)
        gpu = self._exchanges is not None and self._exchanges.gpu_driven
        if self._payloads is not None:  # afd ffn_poll_s: the GPU-driven path's only
            self._payloads.poll_s = self.afd.ffn_poll_s if gpu else 0.0
        self._metrics.connected(view.epoch, reconnect=self._connects > 0, gpu_driven=gpu)
        self._connects += 1
        self._said_unreachable = False
        log.info(
            "afd ffn %s: serving attention ranks %s at epoch %d",
            self.worker_id,
            self._peers,
            view.epoch,
        )

    def run_step(self, payload: Any) -> None:
        assert self._link is not None and self._link.exchange is not None
        assert self.step_runner is not None and self._payloads is not None
        taken = self._payloads.taken_at
        self.step_runner.run(payload, self._link.exchange, self._metrics, self._profiler, taken)

    @property
    def steps(self) -> int:
        return self.step_runner.steps if self.step_runner is not None else 0
