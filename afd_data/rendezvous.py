"""Rendezvous through afd-ctl: the only way a transport learns its peers.

A worker registers with its transport's blob, waits for the expected set, and connects to the
peers the daemon hands back; after every membership change it does so again. A PEER_LOST event
from the daemon interrupts the transport's waits at once, so a dead peer is an error within
the daemon's liveness bound even when NIXL itself has not noticed yet.

    transport = NixlTransport(name, role, rank, config)
    client = ControllerClient(controller, spec, data_plane_blob=transport.blob())
    view = join(client, transport, timeout_s=120)
    ...
    except AfdPeerLost:
        view = rejoin(client, transport, timeout_s=120)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from afd_ctl.client import ControllerClient
from afd_ctl.routing import Role
from afd_ctl.v1 import afd_pb2
from afd_data.errors import AfdBadInput

if TYPE_CHECKING:
    from afd_data.nixl_transport import NixlTransport, PeerSpec

log = logging.getLogger(__name__)


def peers_from_view(view: afd_pb2.View) -> list[PeerSpec]:
    """The transport's peer list from the daemon's view (afd.v1.Peer -> PeerSpec)."""
    from afd_data.nixl_transport import PeerSpec

    return [
        PeerSpec(
            Role.from_proto(p.worker.role), p.worker.role_rank, p.worker.dp_rank, p.data_plane_blob
        )
        for p in view.peers
    ]


def routing_of(view: afd_pb2.View) -> tuple[int, int, int]:
    """The view's membership as the transport routes it: (M, N, FFN groups)."""
    m, n = view.expected_attention, view.expected_ffn
    return m, n, view.ffn_groups or min(m, n)


def join(client: ControllerClient, transport: NixlTransport, timeout_s: float) -> afd_pb2.View:
    """Registers (if not yet), waits for the expected set and connects the transport."""
    client.connect(timeout_s)
    follow_losses(client, transport)
    view = client.wait_complete(timeout_s)
    transport.connect(view.epoch, peers_from_view(view), routing_of(view))
    log.info("data plane connected to %d peer(s) at epoch %d", len(view.peers), view.epoch)
    return view


def rejoin(client: ControllerClient, transport: NixlTransport, timeout_s: float) -> afd_pb2.View:
    """After a peer was lost: waits for the set to be complete again, in a newer epoch than
    the one the transport lost a peer in (NIXL may notice a death before the daemon does),
    and reconnects."""
    view = client.wait_complete(timeout_s, after_epoch=transport.epoch or 0)
    transport.reconnect(view.epoch, peers_from_view(view), routing_of(view))
    log.info("data plane reconnected to %d peer(s) at epoch %d", len(view.peers), view.epoch)
    return view


def follow_view(transport: NixlTransport, view: afd_pb2.View) -> bool:
    """Issue 37, a planned change: reconnects to `view` (the epoch `afd-ctl scale` moved to,
    its routing with it) when it is newer than the transport's; True when it did."""
    if view.epoch <= (transport.epoch or 0):
        return False
    if not view.complete:
        raise AfdBadInput(
            f"epoch {view.epoch} is not complete ({view.expected_attention} attention, "
            f"{view.expected_ffn} ffn expected); reconnect once afd-ctl's view is"
        )
    transport.reconnect(view.epoch, peers_from_view(view), routing_of(view))
    log.info("data plane moved to %d peer(s) at epoch %d", len(view.peers), view.epoch)
    return True


def follow_losses(client: ControllerClient, transport: NixlTransport) -> None:
    """Every PEER_LOST from the daemon interrupts the transport's waits on that peer, and so
    does losing the daemon itself: a payload published meanwhile is never relayed (the step
    would wait its whole bound for outputs that never come), and whatever afd-ctl comes back
    with is a new epoch, so nothing more can happen in this one."""

    def on_event(event: afd_pb2.MembershipEvent) -> None:
        if event.kind == afd_pb2.MembershipEvent.PEER_LOST:
            transport.mark_peer_lost(event.worker.role, event.worker.role_rank, event.reason)

    def on_unreachable(error: Exception) -> None:
        for rank in transport.peer_ranks:
            transport.mark_peer_lost(transport.role.other, rank, f"{error}")

    client.add_listener(on_event)
    client.add_unreachable_listener(on_unreachable)


class StuckLossWatch:
    """A loss only this data plane saw: the transport lost a peer (a wait timed out), yet
    afd-ctl still has a complete view in the transport's epoch, so no newer view will ever
    come by itself. Once that has lasted ``client.rejoin_after_s``, ``check`` rejoins afd-ctl:
    the new epoch makes every peer drop the stuck step and reconnect."""

    def __init__(self, client: ControllerClient, transport: NixlTransport, who: str) -> None:
        self._client = client
        self._transport = transport
        self._who = who
        self._since: float | None = None
        self._controller_lost = False
        client.add_unreachable_listener(self._on_unreachable)

    def _on_unreachable(self, error: Exception) -> None:
        self._controller_lost = True

    @property
    def controller_lost(self) -> bool:
        """The session to afd-ctl broke since the transport last connected: the loss is the
        daemon's, not a peer's (its last view only looks complete)."""
        return self._controller_lost

    def reset(self) -> None:
        """The transport is connected again: a later loss starts its own clock."""
        self._since = None
        self._controller_lost = False

    def check(self) -> bool:
        """True while the loss is only this data plane's (rejoining once it lasted long
        enough); False, and the clock reset, otherwise."""
        transport, view = self._transport, self._client.view
        if (
            transport.lost is None
            or self._controller_lost
            or not view.complete
            or view.epoch != transport.epoch
        ):
            self._since = None
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif now - self._since >= self._client.rejoin_after_s:
            self._since = None
            self._client.rejoin(f"{self._who}: {transport.lost}")
        return True
