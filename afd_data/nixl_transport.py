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

Flow control
------------
Receive slots are indexed by ``(layer % layers_in_flight, stage)``. There are no ack messages:
each direction's traffic is the other direction's credit.

* Attention -> FFN: the attention side may have at most ``layers_in_flight`` layers per stage
  whose outputs it has not yet taken with ``recv_outputs``, never two in one slot;
  ``send_hidden`` refuses (AfdBadInput) instead of overwriting. The FFN side sends the output of
  (layer, stage) only after it has read that layer's hidden states, so an arrived output is the
  credit that frees the FFN's receive slot.
* FFN -> attention: the FFN side writes the output of (layer, stage) only after the hidden states
  of that layer arrived, and the attention side sends those only after ``recv_outputs`` of the
  layer that last used the slot: the hidden states are the credit for the attention's receive
  slot. So views returned by ``recv_outputs(layer, stage)`` stay valid until ``send_hidden`` of
  the next layer in that slot, and views from ``recv_hidden`` until ``send_output`` of that
  (layer, stage).
* A send staging slot is rewritten only after the local WRITEs out of it completed (bounded).
* Steps do not overlap: ``begin_step`` needs every layer of the previous step answered.

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
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from afd_ctl.routing import Role, peer_ranks
from afd_data import notify
from afd_data.blob import PeerBlob, decode_blob, encode_blob, shape_mismatches
from afd_data.config import TransportConfig
from afd_data.errors import (
    AfdBadInput,
    AfdDataError,
    AfdPeerLost,
    AfdProtocolError,
    AfdStaleEpoch,
)
from afd_data.layout import BufferLayout, RowTable
from afd_data.memory import Array, make_memory
from afd_data.nixl_loader import import_nixl
from afd_data.notify import Kind
from afd_data.poll import Backoff, tighten_timer_slack
from afd_data.step_plan import PeerSlice, StepPlan, plan_step, validate_counts

logger = logging.getLogger(__name__)

_nixl_api, nixl_bindings = import_nixl()
nixl_agent = _nixl_api.nixl_agent
nixl_agent_config = _nixl_api.nixl_agent_config

# Every exception type the NIXL bindings raise (nixlRemoteDisconnectError, nixlBackendError...).
_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    obj
    for name, obj in vars(nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
)


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """One peer as the control plane describes it (``afd.v1.Peer``)."""

    role: Role
    role_rank: int
    dp_rank: int
    blob: bytes

    @classmethod
    def of(cls, value: PeerSpec | Sequence[Any]) -> PeerSpec:
        """Accepts a PeerSpec or a (role, role_rank, dp_rank, blob) tuple."""
        if isinstance(value, PeerSpec):
            return value
        try:
            role, role_rank, dp_rank, blob = value
            return cls(Role.parse(role), int(role_rank), int(dp_rank), bytes(blob))
        except (TypeError, ValueError) as e:
            raise AfdBadInput(
                f"peer {value!r:.80}: expected (role, role_rank, dp_rank, blob) ({e})"
            ) from None


@dataclasses.dataclass(frozen=True)
class HiddenBatch:
    """What ``recv_hidden`` returns. Views into the receive slot: valid until ``send_output``
    of the same (layer, stage)."""

    step_id: int
    layer: int
    stage: int
    # (total_rows, hidden_size): every attention peer's rows, concatenated in rank order.
    hidden: Array
    # (total_rows, router_width), or None when router_width is 0.
    router: Array | None
    slices: tuple[PeerSlice, ...]


class _Peer:
    """A connected peer: its agent, prepared remote descriptors, and cached transfer handles."""

    __slots__ = ("spec", "blob", "pos", "agent_name", "label", "table", "dlist", "handles")

    def __init__(self, spec: PeerSpec, blob: PeerBlob, pos: int, label: str):
        self.spec = spec
        self.blob = blob
        self.pos = pos  # index in this worker's peer list (rank order)
        self.agent_name = blob.agent_name
        self.label = label
        self.table: RowTable | None = None
        self.dlist: Any = None
        self.handles: collections.OrderedDict[tuple[int, int, int], Any] = collections.OrderedDict()


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
        self._peer_layout = BufferLayout(config, self.role.other)
        self._mem = make_memory(device)
        self._base = self._mem.allocate(self._layout.total_bytes)
        self._views: dict[tuple[int, int, int, str], Array] = {}
        self._backoff = Backoff(
            config.poll_spin_us * 1e-6, config.poll_sleep_us * 1e-6, config.poll_yield_us * 1e-6
        )
        self._closed = False

        self._agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=config.progress_thread, backends=["UCX"])
        )
        if "UCX" not in self._agent.backends:
            raise AfdBadInput("NIXL has no UCX backend here; the data plane needs UCX")
        region = np.array([[self._base, self._layout.total_bytes, self._mem.device_id]], np.uint64)
        self._reg = self._agent.register_memory(region, self._mem.mem_type)
        self._local_table = self._layout.send_table()
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            self._local_table.descs(self._base, self._mem.device_id),
            self._mem.mem_type,
        )
        self._blob = encode_blob(
            PeerBlob(
                agent_name=name,
                agent_metadata=self._agent.get_agent_metadata(),
                role=self.role,
                role_rank=role_rank,
                mem_type=self._mem.mem_type,
                recv_addr=self._base,
                recv_bytes=self._layout.recv_bytes,
                device_id=self._mem.device_id,
                shape=config.shape_fields(),
            )
        )

        # Membership.
        self._epoch: int | None = None
        self._past_epochs: set[int] = set()
        self._peers: list[_Peer] = []
        self._peer_by_agent: dict[str, _Peer] = {}
        self._lost: AfdPeerLost | None = None

        # Step state.
        self._step: int | None = None
        self._last_step: int | None = None
        self._plan = StepPlan()
        stages = range(config.num_stages)
        self._outstanding: list[dict[int, int]] = [{} for _ in stages]  # slot -> layer
        self._last_layer: list[int] = [-1 for _ in stages]
        self._done: list[set[int]] = [set() for _ in stages]
        self._arrived: dict[tuple[int, int, int, int], int] = {}  # (step, layer, stage, src)
        self._future: list[tuple[str, bytes]] = []  # notifications of a newer epoch
        self._arrival_cap = 4 * self._layout.num_slots * self._layout.num_peers + 16
        # Local WRITEs not yet complete: (handle, peer, slot); per-slot count.
        self._inflight: list[tuple[Any, _Peer, int]] = []
        self._slot_busy = [0] * self._layout.num_slots
        self._expected_kind = Kind.HIDDEN if self.role is Role.FFN else Kind.OUTPUT
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
        return self._blob

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def step_id(self) -> int | None:
        return self._step

    @property
    def lost(self) -> AfdPeerLost | None:
        """The loss this transport saw in its epoch (every wait raises it until reconnect)."""
        return self._lost

    def connect(self, epoch: int, peers: Iterable[PeerSpec | Sequence[Any]]) -> None:
        """Connects to the peers of this epoch: every routed peer, each as (role, role_rank,
        dp_rank, blob). Validates everything before changing anything."""
        self._check_open()
        specs = [PeerSpec.of(p) for p in peers]
        if not isinstance(epoch, int) or epoch < 0:
            raise AfdBadInput(f"epoch must be an integer >= 0, got {epoch!r}")
        if self._epoch is not None and epoch < self._epoch:
            raise AfdStaleEpoch(
                f"connect(epoch={epoch}) but this transport is already at epoch {self._epoch}; "
                "use the control plane's newest view"
            )
        if self._epoch is not None and epoch == self._epoch:
            if sorted((s.role_rank, s.blob) for s in specs) == sorted(
                (p.spec.role_rank, p.spec.blob) for p in self._peers
            ):
                return  # the same view again
            raise AfdBadInput(
                f"connect(epoch={epoch}) with other peers than the ones already connected in "
                "that epoch; a membership change must come with a new epoch"
            )
        new_peers = self._validate_peers(specs)
        self._settle_inflight()

        # A peer whose blob did not change is the same live process: keep its connection
        # (removing a remote agent disconnects it, which the peer would see as a failure).
        kept = {p.spec.role_rank: p for p in self._peers if any(p.spec == s for s in specs)}
        for p in self._peers:
            if kept.get(p.spec.role_rank) is not p:
                self._drop_peer(p)
        peers_now: list[_Peer] = []
        try:
            for fresh in new_peers:
                old = kept.get(fresh.spec.role_rank)
                peers_now.append(old if old is not None else self._add_peer(fresh))
        except AfdBadInput:
            # NIXL refused a peer's metadata: leave the transport unconnected, not half-wired.
            for p in peers_now + [p for p in kept.values() if p not in peers_now]:
                self._drop_peer(p)
            self._peers, self._peer_by_agent, self._inflight = [], {}, []
            self._slot_busy = [0] * self._layout.num_slots
            if self._epoch is not None:
                self._past_epochs.add(self._epoch)
            self._epoch = None
            self._reset_steps()
            raise
        self._peers = peers_now
        self._peer_by_agent = {p.agent_name: p for p in peers_now}

        previous = self._epoch
        if previous is not None:
            self._past_epochs.add(previous)
        self._epoch = epoch
        self._lost = None
        self._reset_steps()
        future, self._future = self._future, []
        for agent_name, msg in future:  # notifications that arrived before this epoch began
            try:
                self._absorb_one(agent_name, msg)
            except AfdProtocolError as e:
                logger.warning("dropped early notification: %s", e)
        logger.info(
            "data plane %s: epoch %s -> %d, connected to %s %s (kept %d)",
            self.name,
            previous,
            epoch,
            self.role.other.label,
            [p.spec.role_rank for p in peers_now],
            len(kept),
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
        if self._lost is None:
            self._lost = AfdPeerLost(
                f"{role.label} rank {role_rank} was reported lost by the control plane"
                + (f" ({reason})" if reason else "")
                + f" in epoch {self._epoch}; reconnect() with the new epoch's peers",
                peer=f"{role.label}:{role_rank}",
                epoch=self._epoch,
            )
            logger.warning("data plane %s: %s", self.name, self._lost)
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
        if epoch is not None and epoch != self._epoch:
            if epoch < (self._epoch or 0):
                raise AfdStaleEpoch(
                    f"payload of step {step_id} is for epoch {epoch}, this transport is at "
                    f"epoch {self._epoch}: drop the stale payload"
                )
            raise AfdBadInput(
                f"payload of step {step_id} is for epoch {epoch}, this transport is connected "
                f"at epoch {self._epoch}: reconnect() with the new view first"
            )
        if not isinstance(step_id, int) or step_id < 0:
            raise AfdBadInput(f"step_id must be an integer >= 0, got {step_id!r}")
        if self._last_step is not None and step_id <= self._last_step:
            raise AfdBadInput(
                f"step_id {step_id} does not increase (last step {self._last_step} in epoch "
                f"{self._epoch}); step ids must strictly increase within an epoch"
            )
        counts = validate_counts(self.config, num_tokens_across_dp)
        self._check_step_finished(f"begin_step({step_id})")
        self.flush()

        plan = plan_step(self.config, self.role, self.role_rank, counts)
        self._plan = plan
        self._step = step_id
        self._last_step = step_id
        for s in range(self.config.num_stages):
            self._last_layer[s] = -1
            self._done[s].clear()
        stale = [k for k in self._arrived if k[0] < step_id]
        for k in stale:
            del self._arrived[k]
        if stale:
            logger.warning(
                "data plane %s: dropped %d unconsumed notification(s) of steps before %d",
                self.name,
                len(stale),
                step_id,
            )

    def end_step(self, timeout_s: float | None = None) -> None:
        """Checks every layer of the step was answered and waits for this side's last WRITEs
        (their notifications leave only while this process polls): call it before idling."""
        self._check_ready()
        self._check_step_finished("end_step()")
        self.flush(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every WRITE this side posted has completed locally; also takes the
        notifications that arrived meanwhile."""
        self._check_ready()
        self._progress()
        if not self._inflight:
            return
        self._wait(
            lambda: not self._inflight,
            self.config.transfer_timeout_s if timeout_s is None else timeout_s,
            lambda: self._inflight_timeout("flush"),
            lambda: [x[1] for x in self._inflight],
        )

    def poll_idle(self) -> None:
        """One poll between steps, for a worker that waits on something else (its control
        plane): a WRITE a peer posted to this side may complete only while this side polls
        too (UCX over TCP), so a peer settling its transfers at reconnect would otherwise
        wait its whole bound for a worker that does nothing. Takes early notifications and
        reaps this side's WRITEs; raises nothing (a loss or a bad message surfaces in the next
        step)."""
        if self._closed or self._epoch is None:
            return
        try:
            self._progress(raise_lost=False)
        except (AfdDataError, *_NIXL_ERRORS) as e:
            logger.debug("data plane %s: while idle: %s", self.name, e)

    # ------------------------------------------------------------------ attention side

    def hidden_buffer(self, layer: int, stage: int) -> tuple[Array, Array | None]:
        """Zero-copy send: the (rows, hidden) and (rows, router) staging views of this rank's
        rows for (layer, stage); fill them and pass them to ``send_hidden``."""
        self._check_role(Role.ATTENTION, "hidden_buffer")
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        self._await_slot(slot)
        rows = self._plan.my_rows[stage]
        cfg = self.config
        hidden = self._view(self._layout.send_hidden[slot].offset, rows, cfg.hidden_size, cfg.dtype)
        router = None
        if cfg.router_width:
            router = self._view(
                self._layout.send_router[slot].offset, rows, cfg.router_width, cfg.router_dtype
            )
        return hidden, router

    def send_hidden(
        self, layer: int, stage: int, hidden: Array, router: Array | None = None
    ) -> None:
        """WRITEs this rank's hidden states (rows = max(1, its token count)) to every FFN
        peer. Asynchronous: returns once posted."""
        self._check_role(Role.ATTENTION, "send_hidden")
        self._check_stage(layer, stage)
        cfg = self.config
        slot = self._layout.slot(layer, stage)
        outstanding = self._outstanding[stage]
        if layer <= self._last_layer[stage]:
            raise AfdBadInput(
                f"send_hidden(layer={layer}, stage={stage}) after layer "
                f"{self._last_layer[stage]} in step {self._step}: layers must increase"
            )
        if slot in outstanding:
            raise AfdBadInput(
                f"send_hidden(layer={layer}, stage={stage}) would overwrite the FFN's receive "
                f"slot still holding layer {outstanding[slot]}: call recv_outputs(layer="
                f"{outstanding[slot]}, stage={stage}) first, or raise layers_in_flight "
                f"(now {cfg.layers_in_flight})"
            )
        rows = self._plan.my_rows[stage]
        hint = lambda: (  # noqa: E731  (built only when the shape is wrong)
            f"attention DP rank {self.role_rank // cfg.attention_tp_size} has "
            f"{self._plan.counts[stage][self.role_rank // cfg.attention_tp_size]} tokens in "
            f"stage {stage} of step {self._step} (an idle rank sends 1 dummy row)"
        )
        hidden = self._mem.check(
            hidden, rows, cfg.hidden_size, cfg.dtype, "send_hidden hidden", hint
        )
        if cfg.router_width:
            if router is None:
                raise AfdBadInput(
                    f"send_hidden: router_width is {cfg.router_width}: pass router=(rows, "
                    f"{cfg.router_width}) {cfg.router_dtype} with the hidden states"
                )
            router = self._mem.check(
                router, rows, cfg.router_width, cfg.router_dtype, "send_hidden router", hint
            )
        elif router is not None:
            raise AfdBadInput("send_hidden: router given but TransportConfig.router_width is 0")

        self._await_slot(slot)
        staged = self._view(self._layout.send_hidden[slot].offset, rows, cfg.hidden_size, cfg.dtype)
        if hidden is not staged and self._mem.data_ptr(hidden) != self._mem.data_ptr(staged):
            self._mem.copy(staged, hidden)
        regions: tuple[int, ...] = (slot,)
        if cfg.router_width:
            staged_r = self._view(
                self._layout.send_router[slot].offset, rows, cfg.router_width, cfg.router_dtype
            )
            if router is not staged_r and self._mem.data_ptr(router) != self._mem.data_ptr(
                staged_r
            ):
                self._mem.copy(staged_r, router)
            regions = (slot, self._layout.num_slots + slot)
        self._mem.sync()
        for peer in self._peers:
            offset = self._plan.offsets[stage][peer.pos]
            self._post(peer, slot, regions, 0, offset, rows, Kind.HIDDEN, layer, stage)
        outstanding[slot] = layer
        self._last_layer[stage] = layer

    def recv_outputs(self, layer: int, stage: int, timeout_s: float | None = None) -> list[Array]:
        """Waits for the output of (layer, stage) from every FFN peer: one (rows, hidden) view
        per FFN peer in rank order. With several (expert-parallel) FFN peers, sum them.
        The views stay valid until send_hidden of the next layer in the same slot."""
        self._check_role(Role.ATTENTION, "recv_outputs")
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        if self._outstanding[stage].get(slot) != layer:
            raise AfdBadInput(
                f"recv_outputs(layer={layer}, stage={stage}): no hidden states of that layer "
                f"are awaiting an output in step {self._step}; call send_hidden first"
            )
        self._await_peers(layer, stage, timeout_s, "outputs")
        rows = self._plan.my_rows[stage]
        cfg = self.config
        outputs = [
            self._view(
                self._layout.recv_output[slot][p.pos].offset, rows, cfg.hidden_size, cfg.dtype
            )
            for p in self._peers
        ]
        del self._outstanding[stage][slot]
        self._done[stage].add(layer)
        return outputs

    # ------------------------------------------------------------------ FFN side

    def recv_hidden(self, layer: int, stage: int, timeout_s: float | None = None) -> HiddenBatch:
        """Waits for (layer, stage) from every attention peer and returns the concatenation
        (views, valid until send_output of the same layer and stage)."""
        self._check_role(Role.FFN, "recv_hidden")
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        held = self._outstanding[stage].get(slot)
        if held is not None:
            raise AfdBadInput(
                f"recv_hidden(layer={layer}, stage={stage}): receive slot still holds layer "
                f"{held}; call send_output(layer={held}, stage={stage}) first"
            )
        if layer in self._done[stage]:
            raise AfdBadInput(
                f"recv_hidden(layer={layer}, stage={stage}) twice in step {self._step}"
            )
        self._await_peers(layer, stage, timeout_s, "hidden states")
        cfg = self.config
        total = self._plan.total_rows[stage]
        hidden = self._view(
            self._layout.recv_hidden[slot].offset, total, cfg.hidden_size, cfg.dtype
        )
        router = None
        if cfg.router_width:
            router = self._view(
                self._layout.recv_router[slot].offset, total, cfg.router_width, cfg.router_dtype
            )
        self._outstanding[stage][slot] = layer
        self._done[stage].add(layer)
        assert self._step is not None
        return HiddenBatch(self._step, layer, stage, hidden, router, self._plan.slices[stage])

    def output_buffer(self, layer: int, stage: int) -> Array:
        """Zero-copy send: the (total_rows, hidden) staging view for the output of (layer,
        stage); compute into it and pass it to ``send_output``."""
        self._check_role(Role.FFN, "output_buffer")
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        self._await_slot(slot)
        cfg = self.config
        return self._view(
            self._layout.send_output[slot].offset,
            self._plan.total_rows[stage],
            cfg.hidden_size,
            cfg.dtype,
        )

    def send_output(self, layer: int, stage: int, output: Array) -> None:
        """WRITEs each attention peer its slice of the (total_rows, hidden) output. This also
        tells the peers this rank is done reading the hidden states of (layer, stage)."""
        self._check_role(Role.FFN, "send_output")
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        if self._outstanding[stage].get(slot) != layer:
            raise AfdBadInput(
                f"send_output(layer={layer}, stage={stage}): hidden states of that layer were "
                f"not received in step {self._step}; call recv_hidden first"
            )
        cfg = self.config
        total = self._plan.total_rows[stage]
        hint = lambda: "rows = sum of the batch's slices (recv_hidden().hidden.shape[0])"  # noqa: E731
        output = self._mem.check(output, total, cfg.hidden_size, cfg.dtype, "send_output", hint)
        self._await_slot(slot)
        staged = self._view(
            self._layout.send_output[slot].offset, total, cfg.hidden_size, cfg.dtype
        )
        if output is not staged and self._mem.data_ptr(output) != self._mem.data_ptr(staged):
            self._mem.copy(staged, output)
        self._mem.sync()
        for peer, piece in zip(self._peers, self._plan.slices[stage], strict=True):
            self._post(peer, slot, (slot,), piece.start, 0, piece.rows, Kind.OUTPUT, layer, stage)
        del self._outstanding[stage][slot]

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Releases handles, remote agents and the registration. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for peer in self._peers:
            self._drop_peer(peer)
        self._peers = []
        self._peer_by_agent = {}
        self._inflight = []
        for what, fn in (
            ("local dlist", lambda: self._local_dlist.release()),
            ("memory", lambda: self._agent.deregister_memory(self._reg)),
        ):
            try:
                fn()
            except _NIXL_ERRORS as e:
                logger.debug("data plane %s: releasing %s failed: %s", self.name, what, e)
        logger.info("data plane %s closed", self.name)

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NixlTransport({self.name!r}, {self.role.label} rank {self.role_rank}, "
            f"epoch {self._epoch}, step {self._step})"
        )

    # ------------------------------------------------------------------ internals: peers

    def _validate_peers(self, specs: list[PeerSpec]) -> list[_Peer]:
        other = self.role.other
        by_rank: dict[int, _Peer] = {}
        mine = self.config.shape_fields()
        for spec in specs:
            where = f"peer {spec.role.label} rank {spec.role_rank}"
            if spec.role is not other:
                raise AfdBadInput(
                    f"{where}: a {self.role.label} worker connects to {other.label} peers only"
                )
            if spec.role_rank not in self.peer_ranks:
                raise AfdBadInput(
                    f"{where}: not routed to {self.role.label} rank {self.role_rank} "
                    f"(its peers are {other.label} ranks {list(self.peer_ranks)} for "
                    f"M={self.config.num_attention}, N={self.config.num_ffn})"
                )
            if spec.role_rank in by_rank:
                raise AfdBadInput(f"{where}: listed twice")
            if other is Role.ATTENTION and spec.dp_rank != (
                spec.role_rank // self.config.attention_tp_size
            ):
                raise AfdBadInput(
                    f"{where}: dp_rank {spec.dp_rank} but role_rank // attention_tp_size is "
                    f"{spec.role_rank // self.config.attention_tp_size}"
                )
            blob = decode_blob(spec.blob, f"{where} blob")
            if blob.role is not spec.role or blob.role_rank != spec.role_rank:
                raise AfdBadInput(
                    f"{where}: its blob says {blob.role.label} rank {blob.role_rank}; the "
                    "control plane handed out the wrong blob"
                )
            diff = shape_mismatches(mine, blob.shape)
            if diff:
                raise AfdBadInput(
                    f"{where}: buffer shape differs ({'; '.join(diff)}); start every worker "
                    "with the same TransportConfig shape fields"
                )
            table = self._peer_layout.recv_table_for(
                peer_ranks(
                    other, spec.role_rank, self.config.num_attention, self.config.num_ffn
                ).index(self.role_rank)
            )
            last = table.regions[-1]
            if last.offset + last.nbytes > blob.recv_bytes:
                raise AfdBadInput(
                    f"{where}: its receive region ({blob.recv_bytes} bytes) is "
                    "smaller than the layout needs"
                )
            peer = _Peer(
                spec,
                blob,
                self.peer_ranks.index(spec.role_rank),
                f"{other.label} rank {spec.role_rank} (agent {blob.agent_name})",
            )
            peer.table = table
            by_rank[spec.role_rank] = peer
        missing = [r for r in self.peer_ranks if r not in by_rank]
        if missing:
            raise AfdBadInput(
                f"connect: missing {other.label} peer(s) {missing} of {self.role.label} rank "
                f"{self.role_rank}; connect once the control plane's view is complete"
            )
        return [by_rank[r] for r in self.peer_ranks]

    def _add_peer(self, peer: _Peer) -> _Peer:
        try:
            loaded = self._agent.add_remote_agent(peer.blob.agent_metadata)
        except _NIXL_ERRORS as e:
            raise AfdBadInput(f"{peer.label}: NIXL refused its agent metadata ({e})") from None
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer.agent_name:
            raise AfdBadInput(
                f"{peer.label}: metadata names agent {loaded_name!r}, blob {peer.agent_name!r}"
            )
        assert peer.table is not None
        peer.dlist = self._agent.prep_xfer_dlist(
            peer.agent_name,
            peer.table.descs(peer.blob.recv_addr, peer.blob.device_id),
            peer.blob.mem_type,
        )
        return peer

    def _drop_peer(self, peer: _Peer) -> None:
        for handle in peer.handles.values():
            try:
                handle.release()
            except _NIXL_ERRORS as e:
                logger.debug("release of a handle to %s failed: %s", peer.label, e)
        peer.handles.clear()
        try:
            if peer.dlist is not None:
                peer.dlist.release()
            self._agent.remove_remote_agent(peer.agent_name)
        except _NIXL_ERRORS as e:
            logger.debug("removing %s failed: %s", peer.label, e)
        peer.dlist = None

    # ------------------------------------------------------------------ internals: transfers

    def _post(
        self,
        peer: _Peer,
        slot: int,
        regions: tuple[int, ...],
        local_row: int,
        remote_row: int,
        rows: int,
        kind: Kind,
        layer: int,
        stage: int,
    ) -> None:
        """Posts one WRITE of ``rows`` rows (per region) with its notification."""
        key = (slot, local_row if kind is Kind.OUTPUT else remote_row, rows)
        handle = peer.handles.get(key)
        if handle is None:
            handle = self._make_handle(peer, regions, local_row, remote_row, rows)
            peer.handles[key] = handle
            self._evict(peer)
        else:
            peer.handles.move_to_end(key)
        msg = notify.pack(
            kind, self._epoch or 0, self._step or 0, layer, stage, self.role_rank, rows
        )
        try:
            state = self._agent.transfer(handle, msg)
        except _NIXL_ERRORS as e:
            raise self._lose(
                peer,
                f"WRITE of {kind.name.lower()} layer {layer} stage {stage} "
                f"failed: {type(e).__name__} {e}",
            ) from None
        if state == "ERR":
            raise self._lose(
                peer, f"WRITE of {kind.name.lower()} layer {layer} stage {stage} returned ERR"
            )
        if state != "DONE":
            self._inflight.append((handle, peer, slot))
            self._slot_busy[slot] += 1

    def _make_handle(
        self, peer: _Peer, regions: tuple[int, ...], local_row: int, remote_row: int, rows: int
    ) -> Any:
        assert peer.table is not None
        local = np.concatenate(
            [
                np.arange(rows, dtype=np.int32) + (self._local_table.start(r) + local_row)
                for r in regions
            ]
        )
        remote = np.concatenate(
            [np.arange(rows, dtype=np.int32) + (peer.table.start(r) + remote_row) for r in regions]
        )
        try:
            return self._agent.make_prepped_xfer(
                "WRITE", self._local_dlist, local, peer.dlist, remote, b""
            )
        except _NIXL_ERRORS as e:
            raise self._lose(peer, f"preparing a WRITE failed: {type(e).__name__} {e}") from None

    def _evict(self, peer: _Peer) -> None:
        """Keeps at most handles_per_peer handles, never releasing one in flight."""
        excess = len(peer.handles) - self.config.handles_per_peer
        if excess <= 0:
            return
        busy = {id(h) for h, _, _ in self._inflight}
        for key in list(peer.handles)[:-1]:
            if excess <= 0:
                break
            handle = peer.handles[key]
            if id(handle) in busy:
                continue
            del peer.handles[key]
            excess -= 1
            try:
                handle.release()
            except _NIXL_ERRORS as e:
                logger.debug("release of an evicted handle failed: %s", e)

    def _view(self, offset: int, rows: int, cols: int, dtype: str) -> Array:
        """A view of the buffer, made once per shape (a torch view costs microseconds)."""
        key = (offset, rows, cols, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            view = self._views[key] = self._mem.view(offset, rows, cols, dtype)
        return view

    def _settle_inflight(self) -> None:
        """Before a membership change: lets this side's WRITEs finish (bounded), so none of an
        old epoch lands after the new epoch's; failed or stuck ones are abandoned."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while self._inflight and time.monotonic() < deadline:
            still = []
            for entry in self._inflight:
                try:
                    state = self._agent.check_xfer_state(entry[0])
                except _NIXL_ERRORS:
                    state = "ERR"
                if state == "PROC":
                    still.append(entry)
            self._inflight = still
            if still:
                time.sleep(self.config.poll_sleep_us * 1e-6)
        if self._inflight:
            logger.warning(
                "data plane %s: abandoning %d unfinished WRITE(s) at reconnect",
                self.name,
                len(self._inflight),
            )
        self._inflight = []
        self._slot_busy = [0] * self._layout.num_slots

    def _await_slot(self, slot: int) -> None:
        """Waits until no local WRITE still reads send staging slot ``slot``."""
        if self._slot_busy[slot]:
            self._wait(
                lambda: not self._slot_busy[slot],
                self.config.transfer_timeout_s,
                lambda: self._inflight_timeout(f"reusing send slot {slot}"),
                lambda: [x[1] for x in self._inflight if x[2] == slot],
            )

    def _inflight_timeout(self, what: str) -> AfdPeerLost:
        peer = self._inflight[0][1]
        return self._lose(
            peer,
            f"a WRITE did not complete within {self.config.transfer_timeout_s} s ({what}); the "
            "peer is dead or stuck",
        )

    # ------------------------------------------------------------------ internals: receiving

    def _await_peers(self, layer: int, stage: int, timeout_s: float | None, what: str) -> None:
        """Waits for (step, layer, stage) from every peer and checks the row counts."""
        step = self._step
        assert step is not None
        keys = [(step, layer, stage, p.spec.role_rank) for p in self._peers]
        arrived = self._arrived
        if not all(k in arrived for k in keys):
            bound = self.config.recv_timeout_s if timeout_s is None else timeout_s

            def missing() -> list[_Peer]:
                return [p for p, k in zip(self._peers, keys, strict=True) if k not in arrived]

            def on_timeout() -> AfdPeerLost:
                gone = missing()
                others = (
                    f" (also missing: {', '.join(p.label for p in gone[1:])})" if gone[1:] else ""
                )
                return self._lose(
                    gone[0],
                    f"no {what} for step {step} layer {layer} stage {stage} within {bound} s"
                    f"{others}; the peer is dead or stuck: wait for the control plane's new "
                    "epoch and reconnect()",
                )

            self._wait(lambda: all(k in arrived for k in keys), bound, on_timeout, missing)
        expect = self._plan.rows_by_rank[stage]
        wrong = [(k[3], arrived[k]) for k in keys if arrived[k] != expect[k[3]]]
        for k in keys:
            del arrived[k]
        if wrong:
            rank, rows = wrong[0]
            raise AfdProtocolError(
                f"{self.role.other.label} rank {rank} sent {rows} rows of {what} for step {step} "
                f"layer {layer} stage {stage}, but this step's DP metadata says {expect[rank]} "
                f"(num_tokens_across_dp {self._plan.counts[stage]}); both sides must call "
                "begin_step with the same payload"
            )

    def _wait(
        self,
        ready: Callable[[], bool],
        timeout_s: float,
        on_timeout: Callable[[], AfdPeerLost],
        awaited: Callable[[], list[_Peer]],
    ) -> None:
        """Polls NIXL until ``ready()``; probes awaited peers; raises on_timeout() at the bound."""
        now = time.monotonic()
        deadline = now + timeout_s
        interval = self.config.probe_interval_s
        next_probe = now + interval
        backoff = self._backoff
        backoff.reset(now)
        tighten_timer_slack()
        while True:
            # What already arrived is delivered even when the peer was reported lost since
            # (it finished its last step and exited): take notifications first.
            self._progress(raise_lost=False)
            if ready():
                return
            if self._lost is not None:
                raise self._lost
            now = time.monotonic()
            if now >= deadline:
                raise on_timeout()
            if now >= next_probe:
                self._probe(awaited())
                next_probe = now + interval
            backoff.pause(now)

    def _progress(self, raise_lost: bool = True) -> None:
        """One poll: raises a pending loss, takes notifications, reaps completed WRITEs."""
        if raise_lost and self._lost is not None:
            raise self._lost
        notifs = self._agent.get_new_notifs()
        if notifs:
            error: Exception | None = None
            for agent_name, msgs in notifs.items():
                for msg in msgs:
                    try:
                        self._absorb_one(agent_name, msg)
                    except AfdProtocolError as e:
                        error = error or e
            if error is not None:
                logger.warning("data plane %s: %s", self.name, error)
                raise error
        if self._inflight:
            still = []
            for entry in self._inflight:
                handle, peer, slot = entry
                try:
                    state = self._agent.check_xfer_state(handle)
                except _NIXL_ERRORS as e:
                    raise self._lose(peer, f"WRITE failed: {type(e).__name__} {e}") from None
                if state == "DONE":
                    self._slot_busy[slot] -= 1
                elif state == "ERR":
                    raise self._lose(peer, "WRITE failed (ERR)")
                else:
                    still.append(entry)
            self._inflight = still

    def _absorb_one(self, agent_name: str, msg: bytes) -> None:
        """Files one notification as arrived, or raises AfdProtocolError (message dropped)."""
        n = notify.unpack(msg, agent_name)
        if n.kind is Kind.PROBE:
            return
        epoch = self._epoch
        if epoch is None or n.epoch > epoch:
            if len(self._future) >= self._arrival_cap:
                raise AfdProtocolError(
                    f"{n.describe()} from agent {agent_name!r}: too many notifications for "
                    f"epochs newer than {epoch}; reconnect() with the new view"
                )
            self._future.append((agent_name, msg))
            return
        if n.epoch < epoch:
            if n.epoch in self._past_epochs:
                # Late traffic of an epoch this transport left: obsolete, not an error.
                logger.info("data plane %s: dropped late %s", self.name, n.describe())
                return
            raise AfdStaleEpoch(
                f"{n.describe()} from agent {agent_name!r} is for epoch {n.epoch}, which this "
                f"transport never joined (it is at epoch {epoch}); dropped: the sender must "
                "reconnect() with the control plane's current view"
            )
        peer = self._peer_by_agent.get(agent_name)
        if peer is None or peer.spec.role_rank != n.src_rank or n.kind is not self._expected_kind:
            raise AfdProtocolError(
                f"{n.describe()} from agent {agent_name!r}: not a {self.role.other.label} peer "
                f"of {self.role.label} rank {self.role_rank} in epoch {epoch} (peers "
                f"{[p.label for p in self._peers]}); dropped"
            )
        if n.stage >= self.config.num_stages:
            raise AfdProtocolError(
                f"{n.describe()}: stage {n.stage} but num_stages is {self.config.num_stages}"
            )
        step = self._step
        if self.role is Role.ATTENTION:
            if (
                n.step != step
                or self._outstanding[n.stage].get(self._layout.slot(n.layer, n.stage)) != n.layer
            ):
                raise AfdProtocolError(
                    f"{n.describe()}: unknown step/layer, this rank is at step {step} and awaits "
                    f"layers {sorted(self._outstanding[n.stage].values())} of stage {n.stage}; "
                    "dropped (is the FFN side running another step?)"
                )
        elif step is not None and (
            n.step < step or (n.step == step and n.layer in self._done[n.stage])
        ):
            raise AfdProtocolError(
                f"{n.describe()}: unknown step, this rank is at step {step}"
                + (f" and already took layer {n.layer}" if n.step == step else "")
                + "; dropped (is the attention side replaying an old step?)"
            )
        key = (n.step, n.layer, n.stage, n.src_rank)
        if key in self._arrived:
            raise AfdProtocolError(f"{n.describe()}: duplicate, dropped")
        if len(self._arrived) >= self._arrival_cap:
            raise AfdProtocolError(
                f"{n.describe()}: more than {self._arrival_cap} notifications waiting to be "
                "received; the sender runs ahead of begin_step/recv calls"
            )
        self._arrived[key] = n.rows

    def _probe(self, peers: list[_Peer]) -> None:
        """A tiny notification to each awaited peer: NIXL raises a disconnect for a dead one."""
        msg = notify.pack(Kind.PROBE, self._epoch or 0, self._step or 0, 0, 0, self.role_rank, 0)
        for peer in {id(p): p for p in peers}.values():
            try:
                self._agent.send_notif(peer.agent_name, msg)
            except _NIXL_ERRORS as e:
                raise self._lose(peer, f"disconnected ({type(e).__name__} {e})") from None

    def _lose(self, peer: _Peer, detail: str) -> AfdPeerLost:
        """Records the loss (every later call raises it until reconnect) and returns it."""
        if self._lost is None:
            self._lost = AfdPeerLost(
                f"{peer.label}: {detail} [epoch {self._epoch}, step {self._step}]",
                peer=f"{peer.spec.role.label}:{peer.spec.role_rank}",
                epoch=self._epoch,
            )
            logger.warning("data plane %s: %s", self.name, self._lost)
        return self._lost

    # ------------------------------------------------------------------ internals: checks

    def _reset_steps(self) -> None:
        self._step = None
        self._last_step = None
        self._plan = StepPlan()
        for s in range(self.config.num_stages):
            self._outstanding[s].clear()
            self._done[s].clear()
            self._last_layer[s] = -1
        self._arrived.clear()

    def _check_step_finished(self, what: str) -> None:
        for s, held in enumerate(self._outstanding):
            if held:
                layer = min(held.values())
                action = (
                    "recv_outputs" if self.role is Role.ATTENTION else "send_output"
                ) + f"(layer={layer}, stage={s})"
                raise AfdBadInput(
                    f"{what} while step {self._step} still has layer {layer} stage {s} "
                    f"unanswered; call {action} first"
                )

    def _check_open(self) -> None:
        if self._closed:
            raise AfdBadInput(f"data plane {self.name} is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if self._lost is not None:
            raise self._lost
        if self._epoch is None:
            raise AfdBadInput(f"data plane {self.name}: call connect(epoch, peers) first")

    def _check_role(self, role: Role, method: str) -> None:
        if self.role is not role:
            raise AfdBadInput(f"{method}() is for {role.label} workers; this is {self.role.label}")

    def _check_stage(self, layer: int, stage: int) -> None:
        self._check_ready()
        if self._step is None:
            raise AfdBadInput(f"data plane {self.name}: call begin_step() before moving tensors")
        if not 0 <= stage < len(self._plan.counts):
            raise AfdBadInput(
                f"stage {stage} is not in step {self._step}, which has "
                f"{len(self._plan.counts)} stage(s)"
            )
        if not 0 <= layer < 1 << 32:
            raise AfdBadInput(f"layer {layer} is not in 0..2**32-1")
