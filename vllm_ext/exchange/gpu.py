"""The GPU-driven hop (afd_data.gpu_hop) as both roles of the vLLM extension drive it.

`GpuPath` sits beside a worker's NixlTransport (vllm_ext.exchange.nixl): the transport connects the
peers and follows epochs; at every connect `GpuPath.connect` chooses the path (peers on this
host with CUDA buffers: the GPU drives the hop; else NIXL) and says which in the log.

Attention side: `exchange` enqueues one layer's round trip on the current CUDA stream, with no
host wait, so vLLM can capture it inside FULL decode graphs; `end_step` waits for the step's
end on the host (bounded), poisoning the flags once a peer is lost or the bound passes, and
fails the step then, before vLLM reads its outputs.

FFN side: `run_layer` enqueues a layer (wait for the rows, compute, answer); `step_enqueued`
marks the step's end and the host goes on to the next payload at once; `check` notices a step
that overran its bound; `drain` releases and empties the stream before a reconnect (the FFN side
maps its attention peers' buffers, so it must not touch them across a change of peers).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from afd_ctl.errors import AfdTimeout
from afd_data.errors import AfdPeerLost
from afd_data.step_plan import StepPlan, plan_step, validate_counts

log = logging.getLogger(__name__)


class GpuPath:
    def __init__(self, transport: Any) -> None:
        from afd_data.gpu_hop import GpuHop

        parts = transport._p
        self.transport = transport
        self.hop = GpuHop(transport.role, transport.role_rank, transport.config, parts.layout,
                          parts.local)  # fmt: skip
        self._inflight: deque[tuple[Any, float, float, int]] = deque()

    @property
    def active(self) -> bool:
        return self.hop.path == "gpu"

    def connect(self, epoch: int, timeout_s: float) -> None:
        """After the transport reconnected (the caller drained this stream before that)."""
        peers = [(p.pos, p.blob) for p in self.transport._p.peers.peers]
        choice = self.hop.connect(epoch, peers, timeout_s, self._idle)
        log.info(
            "afd data path: %s rank %d uses the %s exchange to its %d peer(s) at epoch %d (%s)",
            self.transport.role.label,
            self.transport.role_rank,
            "GPU-driven" if choice.path == "gpu" else "host-driven NIXL",
            len(peers),
            epoch,
            choice.reason,
        )

    def _idle(self) -> None:
        """While connect waits for the peers' drained marks: NIXL progresses, and a peer lost
        meanwhile (it failed to map this buffer and left) ends the wait at once."""
        self.transport.poll_idle()
        lost = self.transport.lost
        if lost is not None:
            raise lost

    def plan(self, counts: list[list[int]]) -> StepPlan:
        config = self.transport.config
        return plan_step(config, self.transport.role, self.transport.role_rank,
                         validate_counts(config, counts))  # fmt: skip

    def _lost(self) -> str | None:
        lost = self.transport.lost
        return None if lost is None else str(lost).removeprefix("afd peer lost: ")

    # -- attention --------------------------------------------------------------------------
    def exchange(self, layer: int, stage: int, hidden: torch.Tensor, router: torch.Tensor | None,
                 out: torch.Tensor) -> None:  # fmt: skip
        self.hop.exchange(
            layer, stage, hidden, router, out, torch.cuda.current_stream().cuda_stream
        )

    def end_step(self, bound_s: float) -> None:
        """After the step's forward was enqueued: waits for it on the host; raises AfdPeerLost
        or AfdTimeout (the step failed) once it had to be poisoned."""
        if torch.cuda.is_current_stream_capturing():
            return  # a captured forward runs nothing now
        done = torch.cuda.Event()
        done.record()
        why = self.hop.drain(done.query, bound_s, self._lost)
        if why is not None:
            self._mark_lost(why)
            raise AfdPeerLost(why) if why.startswith("afd peer lost") else AfdTimeout(why)

    def _mark_lost(self, why: str) -> None:
        """A step that had to be released is a loss the transport keeps (every step fails at
        once until a reconnect; a loss only this data plane saw makes the worker rejoin)."""
        if self.transport.lost is None:
            for rank in self.transport.peer_ranks[:1]:
                self.transport.mark_peer_lost(self.transport.role.other, rank, why)

    # -- FFN --------------------------------------------------------------------------------
    def run_layer(self, layer: int, stage: int, plan: StepPlan, compute: Any) -> None:
        self.hop.ffn_layer(layer, stage, plan.slices[stage],
                           torch.cuda.current_stream().cuda_stream, compute)  # fmt: skip

    def step_enqueued(self, step_id: int, bound_s: float) -> None:
        done = torch.cuda.Event()
        done.record()
        self._inflight.append((done, time.monotonic(), bound_s, step_id))
        self.check()

    def check(self) -> None:
        """Retires finished steps; a step past its bound (or a peer lost under it) is released
        with poison and raises, as a data-plane loss."""
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()
        if not self._inflight:
            return
        _, started, bound_s, step_id = self._inflight[0]
        lost = self._lost()
        if lost is None and time.monotonic() - started <= bound_s:
            return
        why = lost or f"step {step_id} did not finish within {bound_s:.1f} s on the GPU"
        self.drain(why)
        self._mark_lost(why)
        raise AfdPeerLost(f"afd peer lost: {why}")

    def drain(self, reason: str) -> None:
        """Empties the stream of every enqueued step, poisoning at once (nothing more is
        coming for them)."""
        if not self._inflight:
            return
        last = self._inflight[-1][0]
        why = self.hop.drain(last.query, 0.0, lambda: reason)
        self._inflight.clear()
        if why:
            log.warning("afd data path: released the GPU stream's waits: %s", reason)

    def close(self) -> None:
        try:
            self.drain("closing")
        finally:
            self.hop.close()
