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
builds the endpoint of its role (``afd_data.endpoints``), which adds that role's three tensor
calls; the other role's calls refuse. The rest lives in ``agent`` (NIXL agent, registered
buffer), ``peers`` (peer set), ``inbox`` (notifications, no NIXL), ``write_queue`` (WRITEs in
flight), ``credits`` (flow control rules) and ``poller`` (waits, probes, the loss).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from afd_ctl.routing import Role, peer_ranks
from afd_data import credits
from afd_data.agent import NIXL_ERRORS, LocalAgent
from afd_data.config import TransportConfig
from afd_data.credits import Credits
from afd_data.errors import AfdBadInput, AfdDataError, AfdPeerLost, AfdStaleEpoch
from afd_data.inbox import Inbox
from afd_data.layout import BufferLayout
from afd_data.memory import Array
from afd_data.notify import Kind, Notice
from afd_data.peers import PeerSet, PeerSpec, validate_peers
from afd_data.poll import tighten_timer_slack
from afd_data.poller import Poller
from afd_data.step_plan import StepPlan, plan_step, validate_counts
from afd_data.write_queue import WriteQueue

if TYPE_CHECKING:
    from afd_data.endpoints import HiddenBatch

__all__ = ["NixlTransport", "PeerSpec"]

logger = logging.getLogger(__name__)


class NixlTransport:
    """The data plane of one worker; see the module docstring for protocol and flow control."""

    # Set by each role's endpoint (afd_data.endpoints).
    ROLE: ClassVar[Role]
    EXPECTED: ClassVar[Kind]  # the notification kind this role receives
    ANSWER: ClassVar[str]  # the call that answers an outstanding layer

    def __new__(cls, name: str, role: Role | str | int, *args: Any, **kwargs: Any) -> Any:
        """``NixlTransport(...)`` is the endpoint of ``role``: decided here, once."""
        if cls is NixlTransport:
            from afd_data.endpoints import endpoint_class

            cls = endpoint_class(Role.parse(role))
        return super().__new__(cls)

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
        if self.role is not self.ROLE:
            raise AfdBadInput(f"{type(self).__name__} is the {self.ROLE.label} endpoint")
        self.config = config
        count = config.num_attention if self.role is Role.ATTENTION else config.num_ffn
        if not 0 <= role_rank < count:
            raise AfdBadInput(
                f"role_rank {role_rank} is outside 0..{count - 1} "
                f"(TransportConfig.num_{self.role.label})"
            )
        self.role_rank = role_rank
        self.device = device
        self.peer_ranks = peer_ranks(self.role, role_rank, config.num_attention, config.num_ffn)
        self._layout = BufferLayout(config, self.role)
        self._closed = False
        self._local = LocalAgent(name, self.role, role_rank, config, self._layout, device)
        self._agent = self._local.nixl
        self._mem = self._local.mem
        self._view = self._local.view

        self._peers = PeerSet(self._agent)
        self._plan = StepPlan()
        self._credits = Credits.empty(config.num_stages)
        self._inbox = Inbox(
            name,
            self.role,
            role_rank,
            config.num_stages,
            self.EXPECTED,
            4 * self._layout.num_slots * self._layout.num_peers + 16,
            self._screen,
        )
        self._poller = Poller(name, self._agent, config, role_rank, self._progress, self._where)
        self._queue = WriteQueue(
            name,
            self._agent,
            self._local.send_table,
            self._local.send_dlist,
            self._layout.num_slots,
            config,
            self._poller.lose,
            self._poller.wait,
        )
        tighten_timer_slack()
        logger.info(
            "data plane %s: %s rank %d on %s, %d MiB registered (%s), peers %s, config %s",
            name,
            self.role.label,
            role_rank,
            self._mem.label,
            self._layout.total_bytes >> 20,
            self._mem.mem_type,
            list(self.peer_ranks),
            config,
        )

    # ------------------------------------------------------------------ membership

    def blob(self) -> bytes:
        """The opaque rendezvous blob to register with the control plane."""
        return self._local.blob

    @property
    def epoch(self) -> int | None:
        return self._inbox.epoch

    @property
    def step_id(self) -> int | None:
        return self._credits.step

    @property
    def lost(self) -> AfdPeerLost | None:
        """The loss this transport saw in its epoch (every wait raises it until reconnect)."""
        return self._poller.lost

    def connect(self, epoch: int, peers: Iterable[PeerSpec | Sequence[Any]]) -> None:
        """Connects to the peers of this epoch: every routed peer, each as (role, role_rank,
        dp_rank, blob). Validates everything before changing anything."""
        self._check_open()
        specs = [PeerSpec.of(p) for p in peers]
        if not isinstance(epoch, int) or epoch < 0:
            raise AfdBadInput(f"epoch must be an integer >= 0, got {epoch!r}")
        previous = self._inbox.epoch
        if previous is not None and epoch < previous:
            raise AfdStaleEpoch(
                f"connect(epoch={epoch}) but this transport is already at epoch {previous}; "
                "use the control plane's newest view"
            )
        if previous is not None and epoch == previous:
            if self._peers.same(specs):
                return  # the same view again
            raise AfdBadInput(
                f"connect(epoch={epoch}) with other peers than the ones already connected in "
                "that epoch; a membership change must come with a new epoch"
            )
        fresh = validate_peers(
            specs, self.config, self.role, self.role_rank, self.peer_ranks, self._layout
        )
        self._queue.settle()
        try:
            kept = self._peers.rewire(fresh, specs)
        except AfdBadInput:
            # NIXL refused a peer's metadata: leave the transport unconnected, not half-wired.
            self._queue.clear()
            self._inbox.leave_epoch()
            self._reset_steps()
            raise
        self._reset_steps()
        self._inbox.enter_epoch(epoch, self._peers.senders(), self._peers.labels())
        self._poller.lost = None
        logger.info(
            "data plane %s: epoch %s -> %d, connected to %s %s (kept %d)",
            self.name,
            previous,
            epoch,
            self.role.other.label,
            [p.spec.role_rank for p in self._peers.peers],
            kept,
        )

    def reconnect(self, epoch: int, peers: Iterable[PeerSpec | Sequence[Any]]) -> None:
        """After a membership change: drops the old remote agents, connects the new ones, and
        forgets the step in progress. Peers whose blob did not change stay connected."""
        self.connect(epoch, peers)

    def mark_peer_lost(self, role: Role | str | int, role_rank: int, reason: str = "") -> bool:
        """The control plane saw a peer die: every wait raises AfdPeerLost from now on (any
        thread may call this). Returns False, and changes nothing, for a non-peer."""
        role = Role.parse(role)
        if role is not self.role.other or role_rank not in self.peer_ranks:
            return False
        self._poller.report(
            f"{role.label}:{role_rank}",
            f"{role.label} rank {role_rank} was reported lost by the control plane"
            + (f" ({reason})" if reason else ""),
        )
        return True

    # ------------------------------------------------------------------ steps

    def begin_step(
        self,
        step_id: int,
        num_tokens_across_dp: Sequence[Sequence[int]] | Mapping[int, Sequence[int]],
        *,
        epoch: int | None = None,
    ) -> None:
        """Sizes this step from the payload's DP metadata: per stage, one token count per
        attention DP rank. Nothing is registered or allocated."""
        self._check_ready()
        current = self._inbox.epoch
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
        credits.check_next_step(self._credits, step_id, current)
        counts = validate_counts(self.config, num_tokens_across_dp)
        for peer in self._peers.peers:
            if len(counts) > peer.stages:
                raise AfdBadInput(
                    f"step {step_id} has {len(counts)} stages but {peer.label} carries "
                    f"{peer.stages}: every attention worker of a deployment must run the same "
                    "micro-batching (--enable-dbo on all of them or none)"
                )
        credits.check_step_finished(self._credits, f"begin_step({step_id})", self.ANSWER)
        self.flush()

        self._plan = plan_step(self.config, self.role, self.role_rank, counts)
        credits.begin_step(self._credits, step_id)
        self._inbox.purge_before(step_id)

    def end_step(self, timeout_s: float | None = None) -> None:
        """Checks every layer of the step was answered and waits for this side's last WRITEs
        (their notifications leave only while this process polls): call it before idling."""
        self._check_ready()
        credits.check_step_finished(self._credits, "end_step()", self.ANSWER)
        self.flush(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every WRITE this side posted has completed locally; also takes the
        notifications that arrived meanwhile."""
        self._check_ready()
        self._progress()
        self._queue.await_all(timeout_s)

    def poll_idle(self) -> None:
        """One poll between steps, for a worker that waits on something else (its control
        plane): a WRITE a peer posted to this side may complete only while this side polls
        too (UCX over TCP), so a peer settling its transfers at reconnect would otherwise
        wait its whole bound for a worker that does nothing. Takes early notifications and
        reaps this side's WRITEs; raises nothing (a loss or a bad message surfaces in the next
        step)."""
        if self._closed or self._inbox.epoch is None:
            return
        try:
            self._progress(raise_lost=False)
        except (AfdDataError, *NIXL_ERRORS) as e:
            logger.debug("data plane %s: while idle: %s", self.name, e)

    # ------------------------------------------------------------------ the role's calls
    # Each endpoint (afd_data.endpoints) implements its role's three; the others refuse.

    def hidden_buffer(self, layer: int, stage: int) -> tuple[Array, Array | None]:
        raise self._wrong_role(Role.ATTENTION, "hidden_buffer")

    def send_hidden(
        self, layer: int, stage: int, hidden: Array, router: Array | None = None
    ) -> None:
        raise self._wrong_role(Role.ATTENTION, "send_hidden")

    def recv_outputs(self, layer: int, stage: int, timeout_s: float | None = None) -> list[Array]:
        raise self._wrong_role(Role.ATTENTION, "recv_outputs")

    def recv_hidden(self, layer: int, stage: int, timeout_s: float | None = None) -> HiddenBatch:
        raise self._wrong_role(Role.FFN, "recv_hidden")

    def output_buffer(self, layer: int, stage: int) -> Array:
        raise self._wrong_role(Role.FFN, "output_buffer")

    def send_output(self, layer: int, stage: int, output: Array) -> None:
        raise self._wrong_role(Role.FFN, "send_output")

    def _wrong_role(self, role: Role, method: str) -> AfdBadInput:
        return AfdBadInput(f"{method}() is for {role.label} workers; this is {self.role.label}")

    def _screen(self, n: Notice) -> None:
        """The endpoint's credit check of an arriving notification (AfdProtocolError)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Releases handles, remote agents and the registration. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._peers.release_all()
        self._queue.clear()
        self._local.release()
        logger.info("data plane %s closed", self.name)

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NixlTransport({self.name!r}, {self.role.label} rank {self.role_rank}, "
            f"epoch {self._inbox.epoch}, step {self._credits.step})"
        )

    # ------------------------------------------------------------------ internals: waiting

    def _await_peers(self, layer: int, stage: int, timeout_s: float | None, what: str) -> None:
        """Waits for (step, layer, stage) from every peer and checks the row counts."""
        step = self._credits.step
        assert step is not None
        peers = self._peers.peers
        keys = [(step, layer, stage, p.spec.role_rank) for p in peers]
        if not self._inbox.complete(keys):
            bound = self.config.recv_timeout_s if timeout_s is None else timeout_s
            self._poller.await_arrivals(self._inbox, keys, peers, bound, what)
        self._inbox.take(keys, self._plan.rows_by_rank[stage], self._plan.counts[stage], what)

    def _progress(self, raise_lost: bool = True) -> None:
        """One poll: raises a pending loss, takes notifications, reaps completed WRITEs."""
        if raise_lost and self._poller.lost is not None:
            raise self._poller.lost
        notifs = self._agent.get_new_notifs()
        if notifs:
            self._inbox.absorb_all(notifs)
        if self._queue.inflight:
            self._queue.reap()

    def _where(self) -> tuple[int | None, int | None]:
        return self._inbox.epoch, self._credits.step

    # ------------------------------------------------------------------ internals: checks

    def _reset_steps(self) -> None:
        self._plan = StepPlan()
        credits.reset(self._credits)
        self._inbox.arrived.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise AfdBadInput(f"data plane {self.name} is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if self._poller.lost is not None:
            raise self._poller.lost
        if self._inbox.epoch is None:
            raise AfdBadInput(f"data plane {self.name}: call connect(epoch, peers) first")

    def _check_stage(self, layer: int, stage: int) -> None:
        self._check_ready()
        if self._credits.step is None:
            raise AfdBadInput(f"data plane {self.name}: call begin_step() before moving tensors")
        if not 0 <= stage < len(self._plan.counts):
            raise AfdBadInput(
                f"stage {stage} is not in step {self._credits.step}, which has "
                f"{len(self._plan.counts)} stage(s)"
            )
        if not 0 <= layer < 1 << 32:
            raise AfdBadInput(f"layer {layer} is not in 0..2**32-1")
