"""The FFN role: `vllm serve MODEL --afd-role ffn --afd-controller HOST:PORT`.

No scheduler, no KV cache, no HTTP: it loads only the FFN half (vllm_ext.model_split), registers
with afd-ctl and runs one step per AFDControlPayload: for every layer and stage it receives each
attention peer's rows, runs the layer's MLP/MoE over their concatenation and writes each peer
its slice back. It exits 0 on `stop`; any error is logged at once and ends the session, so the
daemon marks the worker lost and the attention side fails fast instead of hanging.

Also runnable as `python -m vllm_ext.ffn_server MODEL --afd-controller ... [vLLM flags]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any

import torch

from afd_ctl import routing
from afd_ctl.errors import (
    AfdControllerUnreachable,
    AfdNotReady,
    AfdPeerLost,
    AfdStopped,
    AfdTimeout,
)
from afd_ctl.payloads import stage_counts
from afd_ctl.routing import Role
from vllm_ext.config import AfdConfig, from_vllm_config
from vllm_ext.control import ControlAccess
from vllm_ext.exchange import FfnExchange, StepShape
from vllm_ext.ffn_graphs import CAPTURE, EAGER, FfnGraphRunner, graph_key
from vllm_ext.ffn_step_graphs import FfnStepGraphs
from vllm_ext.metrics import FfnMetrics, serve_ffn_metrics
from vllm_ext.model_split import router_columns
from vllm_ext.peer_link import PeerLink, expected_counts

log = logging.getLogger("vllm_ext.ffn_server")

POLL_S = 0.5
# While no payload comes: the data plane is polled this often (a peer settling its transfers
# at reconnect needs this side to poll too; see NixlTransport.poll_idle).
IDLE_POLL_S = 0.05
# Waiting for peers: log this often.
WAIT_LOG_S = 30.0
STAT_WINDOW = 1000


class FfnWorker:
    """One FFN rank. `run()` returns the process exit code."""

    def __init__(self, vllm_config: Any, afd: AfdConfig) -> None:
        from vllm_ext.ffn_engine import FfnEngine

        self.vllm_config = vllm_config
        self.afd = afd
        self.worker_id = afd.worker_id or f"ffn-{afd.ffn_rank}-{os.getpid()}"
        self.engine = FfnEngine(vllm_config, finalize=False)
        if afd.gate == "attention":
            self.engine.stack.use_given_router_logits()
        # CUDA graphs per the payload's capture/replay flags, on GPU unless enforce_eager.
        self.graphs = FfnGraphRunner(
            self.engine.forward_layer,
            enabled=not vllm_config.model_config.enforce_eager,
        )
        # The GPU-driven path's graphs: a whole step each (vllm_ext.ffn_step_graphs).
        self.step_graphs = FfnStepGraphs(enabled=not vllm_config.model_config.enforce_eager)
        self.steps = 0
        self.two_stage_steps = 0  # steps the attention side ran as two micro-batches
        # Seconds spent waiting for attention rows, computing, and writing back.
        self.recv_s = self.compute_s = self.send_s = 0.0
        # The same split for each of the last STAT_WINDOW steps (medians: a typical step,
        # which a long profile or prefill step does not skew).
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=STAT_WINDOW)
        self._stop = threading.Event()
        # Told to afd-ctl when this server leaves (its peers' PEER_LOST says "left: ...").
        self._leave_reason = "ffn server exiting"
        self._link: PeerLink | None = None
        self._client: Any = None  # self._link.client
        self._exchange: FfnExchange | None = None
        self._loss_watch: Any = None  # afd_data.rendezvous.StuckLossWatch, once started
        self._peers: list[int] = []  # attention role ranks served, in order of concatenation
        self._profiler: Any = None
        self._said_unreachable = False
        self._metrics = FfnMetrics(None)
        self._connects = 0

    def request_stop(self, reason: str) -> None:
        log.info("afd ffn %s: stop requested (%s)", self.worker_id, reason)
        self._leave_reason = f"ffn server stopping ({reason})"
        self._stop.set()

    def run(self) -> int:
        from afd_ctl.client import WorkerSpec

        afd = self.afd
        hf = self.vllm_config.model_config.hf_config
        access = ControlAccess.of(afd)
        num_attention, num_ffn = expected_counts(access, afd.connect_timeout_s)
        if afd.ffn_rank >= num_ffn:
            raise ValueError(
                f"afd ffn_rank {afd.ffn_rank} but afd-ctl expects {num_ffn} FFN ranks "
                "(--expect-ffn); give each FFN server a distinct ffn_rank below that"
            )
        if afd.metrics_port:
            self._metrics = serve_ffn_metrics(afd.metrics_host, afd.metrics_port)
        shard, shards = expert_shard(afd.ffn_rank, num_attention, num_ffn)
        self.engine.finalize(shard, shards)
        self._exchange = FfnExchange(
            name=self.worker_id,
            rank=afd.ffn_rank,
            dtype=self.vllm_config.model_config.dtype,
            num_attention=num_attention,
            num_ffn=num_ffn,
            hidden_size=hf.hidden_size,
            max_tokens=afd.max_tokens or self.vllm_config.scheduler_config.max_num_batched_tokens,
            timeout_s=afd.step_timeout_s,
            warmup_timeout_s=afd.warmup_timeout_s,
            router=router_columns(hf, self.vllm_config.model_config.dtype, afd.gate),
            attention_tp_size=afd.attention_tp_size,
            num_stages=afd.num_stages,
        )
        spec = WorkerSpec(self.worker_id, Role.FFN, dp_rank=afd.ffn_rank, dp_size=num_ffn)
        self._link = PeerLink(
            access, spec, self._exchange, f"ffn rank {afd.ffn_rank}", self.vllm_config
        )
        self._client, self._loss_watch = self._link.client, self._link.loss_watch
        if afd.profile_dir:
            from vllm_ext.attention_session import _StepProfiler

            self._profiler = _StepProfiler(afd, Role.FFN.label)
        try:
            registered = self._link.register(timeout_s=afd.connect_timeout_s)
            log.info(
                "afd ffn %s: registered as ffn rank %d (expert shard %d of %d); "
                "waiting for the expected set",
                self.worker_id,
                registered.worker.role_rank,
                shard,
                shards,
            )
            view = self._wait_for_peers(after_epoch=0)
            if view is None:
                return 0
            self._connect(view)
            while not self._stop.is_set():
                try:
                    self._check_gpu_steps()
                    payload = self._client.next_payload(timeout_s=IDLE_POLL_S)
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
                    assert self._exchange is not None
                    try:
                        view = self._wait_for_peers(self._exchange.transport.epoch or 0)
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
            log.exception(
                "afd ffn %s: failed at step %d; leaving afd-ctl", self.worker_id, self.steps
            )
            self._leave_reason = (
                f"ffn server failed at step {self.steps}: {type(exc).__name__}: {exc}"
            )
            return 1
        finally:
            self.close()

    def _poll_idle(self) -> None:
        if self._exchange is not None:
            self._exchange.transport.poll_idle()

    def _check_gpu_steps(self) -> None:
        """GPU-driven path: retires finished steps; one past its bound (or under a lost peer)
        raises AfdPeerLost here, in the loop that reconnects."""
        if self._exchange is not None and self._exchange.gpu is not None:
            self._exchange.gpu.check()

    def _follow_epoch(self, payload: Any) -> bool:
        """True when the data plane is in the payload's epoch, reconnecting it first when the
        payload is of a newer one; False for a payload to drop.

        afd-ctl may move to a new epoch without a PEER_LOST reaching this loop: after a
        restart of the daemon both workers register anew, and if this one completes the set
        its registration already brings the complete view of the new epoch. The attention
        side then publishes in that epoch, so its first payload is how the loop learns."""
        assert self._exchange is not None and self._client is not None
        current = self._exchange.transport.epoch or 0
        if payload.epoch == current:
            return True
        if payload.epoch < current:
            log.info(
                "afd ffn %s: dropped step %d of epoch %d (now at epoch %d)",
                self.worker_id,
                payload.step_id,
                payload.epoch,
                current,
            )
            return False
        # The view that made the attention side publish in this epoch came before its payload
        # on the same session stream, so it is already here.
        assert self._link is not None
        try:
            view = self._link.wait_newer(timeout_s=self.afd.step_timeout_s, after_epoch=current)
        except AfdTimeout as exc:
            log.warning(
                "afd ffn %s: dropped step %d of epoch %d: %s",
                self.worker_id,
                payload.step_id,
                payload.epoch,
                exc,
            )
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
            except AfdTimeout as exc:
                self._poll_idle()
                self._loss_watch.check()
                now = time.monotonic()
                if now >= next_log:
                    next_log = now + WAIT_LOG_S
                    log.info(
                        "afd ffn %s: waiting %.0f s so far for the attention side: %s",
                        self.worker_id,
                        now - started,
                        exc,
                    )
        return None

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

    def close(self) -> None:
        log.info("afd ffn %s: stats %s", self.worker_id, json.dumps(self.stats()))
        client, self._client = self._client, None
        exchange, self._exchange = self._exchange, None
        if client is not None:
            client.close(reason=self._leave_reason)
        if exchange is not None:
            try:
                exchange.close()
            except Exception as exc:  # shutting down: report, never raise
                log.warning("afd ffn %s: data plane close: %s", self.worker_id, exc)

    def _connect(self, view: Any) -> None:
        me = self._client.role_rank
        self._peers = sorted(r.attention_rank for r in view.routes if me in r.ffn_ranks)
        assert self._link is not None
        self.step_graphs.reset()  # they hold the previous peers' mapped addresses
        self._link.connect(view)
        self._metrics.connected(
            view.epoch,
            reconnect=self._connects > 0,
            gpu_driven=self._exchange is not None and self._exchange.path == "gpu",
        )
        self._connects += 1
        self._said_unreachable = False
        log.info(
            "afd ffn %s: serving attention ranks %s at epoch %d",
            self.worker_id,
            self._peers,
            view.epoch,
        )

    @torch.inference_mode()
    def run_step(self, payload: Any) -> None:
        """All layers of one step: per layer and stage, the peers' rows in, their slices out."""
        assert self._exchange is not None
        stages = stage_counts(payload)
        shape = StepShape(
            step_id=payload.step_id,
            stages=stages,
            epoch=payload.epoch,
            warmup=payload.is_warmup or payload.is_profile or payload.is_graph_capturing,
        )
        exchange = self._exchange
        exchange.begin_step(shape)
        self.graphs.begin_step(payload)
        if exchange.path == "gpu":
            self._enqueue_gpu_step(payload, sorted(stages))
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
        self._recent.append((recv_s, compute_s, send_s))
        self._metrics.step(compute_s, recv_s, self.graphs.mode)
        self.steps += 1
        self.two_stage_steps += len(stages) > 1
        if self._profiler is not None:
            self._profiler.step(payload.step_id)
        if self.steps == 1 or self.steps % 1000 == 0:
            log.info(
                "afd ffn %s: %d steps served (last %d)", self.worker_id, self.steps, payload.step_id
            )

    def _enqueue_gpu_step(self, payload: Any, stages: list[int]) -> None:
        """The GPU-driven path: every layer of the step goes onto the stream at once (wait for
        the rows, compute, answer: afd_data.gpu_hop), and the host moves on to the next
        payload; `GpuPath.check` notices a step that overruns its bound. The host's time here
        is enqueueing, counted as compute."""
        assert self._exchange is not None and self._exchange.gpu is not None
        gpu, plan = self._exchange.gpu, self._exchange.plan
        layers = [(layer, stage) for layer in range(self.engine.num_layers) for stage in stages]
        forward = self.engine.forward_layer

        def run(layer: int, x: Any, router: Any) -> Any:
            return forward(layer, x) if router is None else forward(layer, x, router)

        def enqueue() -> None:
            for layer, stage in layers:
                gpu.run_layer(layer, stage, plan, lambda x, r, layer=layer: run(layer, x, r))

        def warm_up() -> None:  # each layer's compute once, outside the graph
            for layer, stage in layers:
                run(layer, *gpu.hop.ffn_inputs(layer, stage, plan.slices[stage]))

        t0 = time.perf_counter()
        with self.engine.step_scope():
            if self.graphs.mode != EAGER and self.step_graphs.enabled:
                self.step_graphs.run(graph_key(payload), self.graphs.mode == CAPTURE, warm_up,
                                     enqueue)  # fmt: skip
            else:
                enqueue()
        gpu.step_enqueued(payload.step_id, self._exchange.step_bound_s)
        enqueue_s = time.perf_counter() - t0
        self.compute_s += enqueue_s
        self._recent.append((0.0, enqueue_s, 0.0))
        self._metrics.step(enqueue_s, 0.0, self.graphs.mode)
        self.steps += 1
        self.two_stage_steps += len(stages) > 1
        if self.steps == 1 or self.steps % 1000 == 0:
            log.info(
                "afd ffn %s: %d steps served (last %d, GPU-driven)",
                self.worker_id,
                self.steps,
                payload.step_id,
            )


def expert_shard(ffn_rank: int, num_attention: int, num_ffn: int) -> tuple[int, int]:
    """(shard, shards) of an FFN rank. afd-ctl routes attention rank a to FFN rank f iff
    a % k == f % k with k = min(M, N); the FFN ranks of one group split the experts."""
    group = routing.ffn_group(ffn_rank, num_attention, num_ffn)
    return group.index(ffn_rank), len(group)


def serve_ffn(args: argparse.Namespace) -> None:
    """`vllm serve --afd-role ffn`: build the config the way `vllm serve` would, then run."""
    from vllm_ext import compat

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    seams = compat.seams()
    _, async_engine_args = seams.engine_args_classes()
    engine_args = async_engine_args.from_cli_args(args)
    # As `vllm serve` creates it for the attention role: the same defaults on both sides.
    vllm_config = engine_args.create_engine_config(usage_context=seams.serve_usage_context())
    afd = from_vllm_config(vllm_config)
    if afd is None or afd.role is not Role.FFN:
        raise ValueError("serve_ffn needs --afd-role ffn and --afd-controller")
    sys.exit(run_worker(vllm_config, afd))


def run_worker(vllm_config: Any, afd: AfdConfig) -> int:
    worker = FfnWorker(vllm_config, afd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: worker.request_stop(signal.Signals(s).name))
    return worker.run()


def main(argv: list[str] | None = None) -> None:
    import vllm_ext
    from vllm_ext import compat

    vllm_ext.register()
    seams = compat.seams()
    _, async_engine_args = seams.engine_args_classes()
    parser = seams.flexible_argument_parser()(
        description="AFD FFN worker (same flags as vllm serve)"
    )
    parser.add_argument("model")
    parser = async_engine_args.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.afd_role is None:
        args.afd_role = "ffn"
    serve_ffn(args)


if __name__ == "__main__":
    main()
