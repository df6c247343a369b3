"""The peer set: the workers of the other role this one exchanges tensors with in an epoch.

``PeerSpec`` is a peer as the control plane hands it out; ``validate_peers`` checks a whole view
(roles, routing, blobs, buffer shapes) before anything changes; ``PeerSet`` wires the NIXL
side of a validated view (remote agents, prepared descriptor lists, one per row, built once per
peer), keeping the connection of every peer whose blob did not change.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from afd_ctl.routing import Role, peer_ranks
from afd_data.agent import NIXL_ERRORS
from afd_data.blob import PeerBlob, decode_blob, shape_mismatches
from afd_data.config import TransportConfig
from afd_data.errors import AfdBadInput
from afd_data.layout import BufferLayout, RowTable, peer_recv_table

logger = logging.getLogger(__name__)


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


class Peer:
    """A connected peer: its agent, prepared remote descriptors, and cached transfer handles."""

    __slots__ = (
        "spec",
        "blob",
        "pos",
        "agent_name",
        "label",
        "stages",
        "table",
        "dlist",
        "handles",
    )

    def __init__(self, spec: PeerSpec, blob: PeerBlob, pos: int, label: str):
        self.spec = spec
        self.blob = blob
        self.pos = pos  # index in this worker's peer list (rank order)
        self.agent_name = blob.agent_name
        self.label = label
        self.stages = 1  # micro-batches it carries (validate_peers sets it)
        self.table: RowTable | None = None
        self.dlist: Any = None
        # (slot, local row, remote row, rows) -> prepared WRITE handle, least recent first.
        self.handles: collections.OrderedDict[tuple[int, int, int, int], Any] = (
            collections.OrderedDict()
        )


def validate_peers(
    specs: list[PeerSpec],
    config: TransportConfig,
    role: Role,
    role_rank: int,
    ranks: tuple[int, ...],
    layout: BufferLayout,
) -> list[Peer]:
    """The peers of ``role_rank`` (routed to it: ``ranks``) in rank order, unwired; AfdBadInput
    names the first peer that is wrong or missing. ``layout`` is this worker's own."""
    other = role.other
    by_rank: dict[int, Peer] = {}
    mine = config.compared_shape_fields()
    peer_layouts: dict[int, BufferLayout] = {}
    for spec in specs:
        where = f"peer {spec.role.label} rank {spec.role_rank}"
        if spec.role is not other:
            raise AfdBadInput(
                f"{where}: a {role.label} worker connects to {other.label} peers only"
            )
        if spec.role_rank not in ranks:
            raise AfdBadInput(
                f"{where}: not routed to {role.label} rank {role_rank} "
                f"(its peers are {other.label} ranks {list(ranks)} for "
                f"M={config.num_attention}, N={config.num_ffn}, "
                f"ffn_groups={config.ffn_groups})"
            )
        if spec.role_rank in by_rank:
            raise AfdBadInput(f"{where}: listed twice")
        if other is Role.ATTENTION and spec.dp_rank != (spec.role_rank // config.attention_tp_size):
            raise AfdBadInput(
                f"{where}: dp_rank {spec.dp_rank} but role_rank // attention_tp_size is "
                f"{spec.role_rank // config.attention_tp_size}"
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
        stages = check_stages(config.num_stages, blob.shape.get("num_stages"), role, where)
        if stages not in peer_layouts:
            peer_layouts[stages] = BufferLayout(
                dataclasses.replace(config, num_stages=stages), other
            )
        table = peer_recv_table(
            layout,
            peer_layouts[stages],
            peer_ranks(
                other,
                spec.role_rank,
                config.num_attention,
                config.num_ffn,
                groups=config.ffn_groups,
            ).index(role_rank),
            blob.recv_bytes,
            where,
        )
        peer = Peer(
            spec,
            blob,
            ranks.index(spec.role_rank),
            f"{other.label} rank {spec.role_rank} (agent {blob.agent_name})",
        )
        peer.table, peer.stages = table, stages
        by_rank[spec.role_rank] = peer
    missing = [r for r in ranks if r not in by_rank]
    if missing:
        raise AfdBadInput(
            f"connect: missing {other.label} peer(s) {missing} of {role.label} rank "
            f"{role_rank}; connect once the control plane's view is complete"
        )
    return [by_rank[r] for r in ranks]


def check_stages(mine: int, theirs: Any, role: Role, where: str) -> int:
    """The peer's stage count, if the two workers can share steps: an FFN worker carries at
    least as many stages (micro-batches per step) as each of its attention peers. The attention
    side decides how many a step has; an FFN worker that carries two follows one-stage and
    two-stage attention peers alike."""
    if theirs not in (1, 2):
        raise AfdBadInput(f"{where}: its blob carries num_stages {theirs!r}, not 1 or 2")
    attention, ffn = (mine, theirs) if role is Role.ATTENTION else (theirs, mine)
    if attention > ffn:
        raise AfdBadInput(
            f"{where}: the attention side runs {attention} stages per step (dual-batch overlap) "
            f"but the FFN side carries {ffn}; give the FFN workers num_stages {attention} "
            "(vLLM: afd num_stages, default 2)"
        )
    return int(theirs)


class PeerSet:
    """The connected peers of the current epoch, in rank order, and their NIXL wiring."""

    def __init__(self, agent: Any):
        self._agent = agent  # the local nixl_agent
        self.peers: list[Peer] = []

    def same(self, specs: Sequence[PeerSpec]) -> bool:
        """Whether ``specs`` is the view already connected (the same ranks and blobs)."""
        return sorted((s.role_rank, s.blob) for s in specs) == sorted(
            (p.spec.role_rank, p.spec.blob) for p in self.peers
        )

    def senders(self) -> dict[str, int]:
        """Agent name -> role rank: who may notify this worker."""
        return {p.agent_name: p.spec.role_rank for p in self.peers}

    def labels(self) -> list[str]:
        return [p.label for p in self.peers]

    def rewire(self, fresh: list[Peer], specs: Sequence[PeerSpec]) -> int:
        """Connects the validated ``fresh`` peers and returns how many were kept. A peer whose
        blob did not change is the same live process: its connection stays (removing a remote
        agent disconnects it, which the peer would see as a failure). If NIXL refuses a peer
        (AfdBadInput), nothing stays connected: not half-wired."""
        kept = {p.spec.role_rank: p for p in self.peers if any(p.spec == s for s in specs)}
        for p in self.peers:
            if kept.get(p.spec.role_rank) is not p:
                self._drop(p)
        peers_now: list[Peer] = []
        try:
            for peer in fresh:
                old = kept.get(peer.spec.role_rank)
                peers_now.append(old if old is not None else self._add(peer))
        except AfdBadInput:
            for p in peers_now + [p for p in kept.values() if p not in peers_now]:
                self._drop(p)
            self.peers = []
            raise
        self.peers = peers_now
        return len(kept)

    def release_all(self) -> None:
        """At close: every handle, descriptor list and remote agent."""
        for peer in self.peers:
            self._drop(peer)
        self.peers = []

    def _add(self, peer: Peer) -> Peer:
        try:
            loaded = self._agent.add_remote_agent(peer.blob.agent_metadata)
        except NIXL_ERRORS as e:
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

    def _drop(self, peer: Peer) -> None:
        for handle in peer.handles.values():
            try:
                handle.release()
            except NIXL_ERRORS as e:
                logger.debug("release of a handle to %s failed: %s", peer.label, e)
        peer.handles.clear()
        try:
            if peer.dlist is not None:
                peer.dlist.release()
            self._agent.remove_remote_agent(peer.agent_name)
        except NIXL_ERRORS as e:
            logger.debug("removing %s failed: %s", peer.label, e)
        peer.dlist = None
