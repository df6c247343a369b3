"""NixlTransport: hidden states attention -> FFN and outputs FFN -> attention, every layer and
stage of a step, over NIXL WRITEs (UCX: VRAM on GPU, host DRAM on CPU-only machines).

Protocol
--------
* Push only. Each side WRITEs into the peer's receive buffer, registered once at start-up, and
  attaches a notification naming kind, epoch, step, layer, stage, source rank and row count
  (``afd_data.notify``). The receiver matches notifications against what the step's DP metadata
  says must arrive; anything else is refused with a typed error.
* Routing (``afd_data.routing``): an FFN rank receives from every attention rank routed to it,
  packed back to back in role-rank order, so ``recv_hidden`` returns one contiguous batch plus
  each peer's slice, and ``send_output`` WRITEs each peer its slice. An attention rank with
  several FFN peers (1:2, expert-parallel FFN ranks) sends each the same hidden states and
  ``recv_outputs`` returns one output per FFN peer: the caller sums them.
* Row counts come from ``begin_step``: attention DP rank ``d`` contributes
  ``max(1, num_tokens_across_dp[stage][d])`` rows (an idle rank sends one dummy row).
* Prepared descriptor lists (one descriptor per row) are built once per peer at ``connect``;
  per transfer only indices are chosen, and the transfer handle for a (slot, offset, rows) is
  made once and re-posted afterwards.
* Flow control: no ack messages, each direction's traffic is the other direction's credit
  (``afd_data.credits``).

Progress
--------
Without a progress thread nothing moves unless this process calls into NIXL, and a
notification attached to a WRITE leaves only while the initiator polls. Every wait here polls
(spin briefly, then short sleeps, bounded by its deadline), and ``end_step``/``flush`` wait for
the step's last WRITEs, so call ``end_step`` before going idle (the FFN side between steps).

Failure
-------
A NIXL disconnect, a WRITE that fails or does not complete in time, a notification missing past
its bound (peers awaited for longer than ``probe_interval_s`` are probed, so a dead process
surfaces as a disconnect long before that), or ``mark_peer_lost`` from the control plane raises
``AfdPeerLost`` ("afd peer lost: ..."); the transport then refuses everything until
``reconnect(epoch, peers)`` with the new membership.

Not thread-safe, except ``mark_peer_lost``, which any thread may call.

Pieces
------
This module is what both roles share: membership and steps. ``NixlTransport(name, role, ...)``
wires its parts with ``afd_data.transport_parts.build_parts`` and takes the endpoint of its role
from ``afd_data.endpoints.endpoint_for``, which does that role's three tensor calls; the other
role's calls refuse. The parts live in ``agent`` (NIXL agent, registered buffer), ``peers``
(peer set), ``inbox`` (notifications, no NIXL), ``write_queue`` (WRITEs in flight),
``credits`` (flow control rules), ``poller`` (waits, probes) and ``loss`` (the first loss).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from afd_ctl.routing import Role
from afd_ctl.step import Step
from afd_data import credits
from afd_data.agent import NIXL_ERRORS, LocalAgent
from afd_data.blob import PeerBlob
from afd_data.config import TransportConfig
from afd_data.endpoints import HiddenBatch, endpoint_for
from afd_data.errors import AfdBadInput, AfdDataError, AfdPeerLost, AfdStaleEpoch
from afd_data.layout import BufferLayout
from afd_data.memory import Array
from afd_data.peers import PeerSpec, validate_peers
from afd_data.poll import tighten_timer_slack
from afd_data.step_plan import plan_step, validate_counts
from afd_data.transport_parts import build_parts, routed_peers

__all__ = ["NixlTransport", "PeerSpec"]

logger = logging.getLogger(__name__)

# What one poll between steps may raise (and poll_idle only logs).
_IDLE_ERRORS: tuple[type[BaseException], ...] = (AfdDataError, *NIXL_ERRORS)


class NixlTransport:
    """The data plane of one worker; see the module docstring for protocol and flow control."""

    def __init__(
        self,
        name: str,
        role: Role | str | int,
        role_rank: int,
        config: TransportConfig,
        device: str = "cpu",
    ):
        self.name = name
        self.role = Role.parse(role)
        self.config = config
        self.role_rank = role_rank
        self.device = device
        self._p = build_parts(name, self.role, role_rank, config, device)
        self._endpoint = endpoint_for(self._p)
        self.peer_ranks = self._p.peer_ranks
        self.loss = self._p.loss  # its `listeners` hear an epoch's first loss (any thread)
        tighten_timer_slack()
        logger.info(
            "data plane %s: %s rank %d on %s, %d MiB registered (%s), peers %s, config %s",
            name,
            self.role.label,
            role_rank,
            self._p.mem.label,
            self._p.layout.total_bytes >> 20,
            self._p.mem.mem_type,
            list(self.peer_ranks),
            config,
        )

    # ------------------------------------------------------------------ membership

    def blob(self) -> bytes:
        """The opaque rendezvous blob to register with the control plane."""
        return self._p.local.blob

    @property
    def epoch(self) -> int | None:
        return self._p.inbox.epoch

    @property
    def step_id(self) -> int | None:
        return self._p.credits.step

    @property
    def layout(self) -> BufferLayout:
        """Where each slot lives in the registered buffer."""
        return self._p.layout

    @property
    def local(self) -> LocalAgent:
        """This worker's NIXL agent and registered buffer (the GPU hop uses its memory)."""
        return self._p.local

    def peer_blobs(self) -> list[tuple[int, PeerBlob]]:
        """The connected peers' decoded blobs, each with its position in this worker's peer
        list (rank order)."""
        return [(peer.pos, peer.blob) for peer in self._p.peers.peers]

    @property
    def lost(self) -> AfdPeerLost | None:
        """The loss this transport saw in its epoch (every wait raises it until reconnect)."""
        return self._p.loss.lost

    def connect(
        self,
        epoch: int,
        peers: Iterable[PeerSpec | Sequence[Any]],
        routing: tuple[int, int, int] | None = None,
    ) -> None:
        """Connects to the peers of this epoch: every routed peer, each as (role, role_rank,
        dp_rank, blob). ``routing`` (M, N, FFN groups) is the epoch's membership, when it may
        differ from the start-up one (an elastic config, issue 37). Validates everything before
        changing anything."""
        p = self._p
        p.check_open()
        specs = [PeerSpec.of(x) for x in peers]
        config = self.config if routing is None else self.config.with_routing(*routing)
        count = config.num_attention if self.role is Role.ATTENTION else config.num_ffn
        if not 0 <= self.role_rank < count:
            raise AfdBadInput(
                f"connect: {self.role.label} rank {self.role_rank} is not in the membership "
                f"{config.num_attention}:{config.num_ffn}"
            )
        ranks = routed_peers(config, self.role, self.role_rank)
        if not isinstance(epoch, int) or epoch < 0:
            raise AfdBadInput(f"epoch must be an integer >= 0, got {epoch!r}")
        previous = p.inbox.epoch
        if previous is not None and epoch < previous:
            raise AfdStaleEpoch(
                f"connect(epoch={epoch}) but this transport is already at epoch {previous}; "
                "use the control plane's newest view"
            )
        if previous is not None and epoch == previous and config is self.config:
            if p.peers.same(specs):
                return  # the same view again
            raise AfdBadInput(
                f"connect(epoch={epoch}) with other peers than the ones already connected in "
                "that epoch; a membership change must come with a new epoch"
            )
        fresh = validate_peers(specs, config, self.role, self.role_rank, ranks, p.layout)
        p.queue.settle()
        try:
            kept = p.peers.rewire(fresh, specs)
        except AfdBadInput:
            # NIXL refused a peer's metadata: leave the transport unconnected, not half-wired.
            p.queue.clear()
            p.inbox.leave_epoch()
            p.reset_steps()
            raise
        p.reset_steps()
        if config is not self.config:
            logger.info(
                "data plane %s: membership %d:%d (%d FFN group(s)) -> %d:%d (%d)",
                self.name,
                self.config.num_attention,
                self.config.num_ffn,
                self.config.ffn_groups,
                config.num_attention,
                config.num_ffn,
                config.ffn_groups,
            )
            self.config = p.config = config
            self.peer_ranks = p.peer_ranks = ranks
        p.inbox.enter_epoch(epoch, p.peers.senders(), p.peers.labels())
        p.loss.lost = None
        logger.info(
            "data plane %s: epoch %s -> %d, connected to %s %s (kept %d)",
            self.name,
            previous,
            epoch,
            self.role.other.label,
            [x.spec.role_rank for x in p.peers.peers],
            kept,
        )

    def reconnect(
        self,
        epoch: int,
        peers: Iterable[PeerSpec | Sequence[Any]],
        routing: tuple[int, int, int] | None = None,
    ) -> None:
        """After a membership change: drops the old remote agents, connects the new ones, and
        forgets the step in progress. Peers whose blob did not change stay connected."""
        self.connect(epoch, peers, routing)

    def mark_peer_lost(self, role: Role | str | int, role_rank: int, reason: str = "") -> bool:
        """The control plane saw a peer die: every wait raises AfdPeerLost from now on (any
        thread may call this). Returns False, and changes nothing, for a non-peer."""
        role = Role.parse(role)
        if role is not self.role.other or role_rank not in self.peer_ranks:
            return False
        self._p.loss.report(
            f"{role.label}:{role_rank}",
            f"{role.label} rank {role_rank} was reported lost by the control plane"
            + (f" ({reason})" if reason else ""),
        )
        return True

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: Step) -> None:
        """Sizes this step from its token counts (per stage, one per attention DP rank) and
        checks its epoch. Nothing is registered or allocated."""
        p = self._p
        p.check_ready()
        current = p.inbox.epoch
        step_id, epoch = step.step_id, step.epoch
        if epoch is not None and epoch != current:
            if epoch < (current or 0):
                raise AfdStaleEpoch(
                    f"payload of step {step_id} is for epoch {epoch}, this transport is at "
                    f"epoch {current}: drop the stale payload"
                )
            raise AfdBadInput(
                f"payload of step {step_id} is for epoch {epoch}, this transport is connected "
                f"at epoch {current}: reconnect() with the new view first"
            )
        credits.check_next_step(p.credits, step_id, current)
        counts = validate_counts(self.config, step.counts)
        for peer in p.peers.peers:
            if len(counts) > peer.stages:
                raise AfdBadInput(
                    f"step {step_id} has {len(counts)} stages but {peer.label} carries "
                    f"{peer.stages}: every attention worker of a deployment must run the same "
                    "micro-batching (--enable-dbo on all of them or none)"
                )
        credits.check_step_finished(p.credits, f"begin_step({step_id})", self._endpoint.ANSWER)
        self.flush()

        p.plan = plan_step(self.config, self.role, self.role_rank, counts)
        credits.begin_step(p.credits, step_id)
        p.inbox.purge_before(step_id)

    def end_step(self, timeout_s: float | None = None) -> None:
        """Checks every layer of the step was answered and waits for this side's last WRITEs
        (their notifications leave only while this process polls): call it before idling."""
        self._p.check_ready()
        credits.check_step_finished(self._p.credits, "end_step()", self._endpoint.ANSWER)
        self.flush(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every WRITE this side posted has completed locally; also takes the
        notifications that arrived meanwhile."""
        self._p.check_ready()
        self._p.poller.progress()
        self._p.poller.await_all(timeout_s)

    def poll_idle(self) -> None:
        """One poll between steps, for a worker that waits on something else (its control
        plane): a WRITE a peer posted to this side may complete only while this side polls
        too (UCX over TCP), so a peer settling its transfers at reconnect would otherwise
        wait its whole bound for a worker that does nothing. Takes early notifications and
        reaps this side's WRITEs; raises nothing (a loss or a bad message surfaces in the next
        step)."""
        if self._p.closed or self._p.inbox.epoch is None:
            return
        try:
            self._p.poller.progress(raise_lost=False)
        except _IDLE_ERRORS as e:
            logger.debug("data plane %s: while idle: %s", self.name, e)

    # ------------------------------------------------------------------ the role's calls
    # The role's endpoint (afd_data.endpoints) does its three; the other role's refuse.

    def hidden_buffer(self, layer: int, stage: int) -> tuple[Array, Array | None]:
        return self._endpoint.hidden_buffer(layer, stage)

    def send_hidden(
        self, layer: int, stage: int, hidden: Array, router: Array | None = None
    ) -> None:
        self._endpoint.send_hidden(layer, stage, hidden, router)

    def recv_outputs(self, layer: int, stage: int, timeout_s: float | None = None) -> list[Array]:
        return self._endpoint.recv_outputs(layer, stage, timeout_s)

    def recv_hidden(self, layer: int, stage: int, timeout_s: float | None = None) -> HiddenBatch:
        return self._endpoint.recv_hidden(layer, stage, timeout_s)

    def output_buffer(self, layer: int, stage: int) -> Array:
        return self._endpoint.output_buffer(layer, stage)

    def send_output(self, layer: int, stage: int, output: Array) -> None:
        self._endpoint.send_output(layer, stage, output)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Releases handles, remote agents and the registration. Idempotent."""
        p = self._p
        if p.closed:
            return
        p.closed = True
        p.peers.release_all()
        p.queue.clear()
        p.local.release()
        logger.info("data plane %s closed", self.name)

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NixlTransport({self.name!r}, {self.role.label} rank {self.role_rank}, "
            f"epoch {self._p.inbox.epoch}, step {self._p.credits.step})"
        )
