"""Buffer layout: where every receive and send slot lives in a worker's one registered buffer.

A worker and each of its peers compute the same layout from the same TransportConfig, so a
sender knows the byte address of every row it writes into a peer from the peer's base address
alone (the blob carries it).

One buffer per worker, receive part first (the only part peers see), send staging after:

* attention worker: ``recv_output[slot][ffn_pos]`` (max_tokens rows each: one area per FFN
  peer), then ``send_hidden[slot]`` and ``send_router[slot]`` (max_tokens rows each);
* FFN worker: ``recv_hidden[slot]`` and ``recv_router[slot]`` (P * max_tokens rows each, the
  attention peers packed back to back in role-rank order, so the concatenation is one
  contiguous view), then ``send_output[slot]`` (same packing).

``slot = stage * layers_in_flight + layer % layers_in_flight``: stage 0's slots come first, so
they sit at the same place whatever a worker's ``num_stages``. That is what lets an FFN worker
that carries two stages serve attention peers that carry one (``peer_recv_table``). NIXL
descriptors are one per row, so any row range is a list of indices and NIXL merges the
contiguous run into one transfer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from afd_ctl.routing import Role, max_peers
from afd_data.config import TransportConfig
from afd_data.errors import AfdBadInput

_ALIGN = 256  # byte alignment of every region (GPU-friendly, and a row never straddles two)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True)
class Region:
    """A run of equal rows inside the buffer."""

    offset: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


class RowTable:
    """Regions listed for a NIXL descriptor list, one descriptor per row.

    ``start(i)`` is the descriptor index of row 0 of region ``i``.
    """

    def __init__(self, regions: list[Region]):
        self.regions = regions
        starts = np.cumsum([0] + [r.rows for r in regions])
        self._starts = [int(s) for s in starts]
        self.num_descs = self._starts[-1]

    def start(self, region: int) -> int:
        return self._starts[region]

    def descs(self, base_addr: int, device_id: int) -> np.ndarray:
        """The Nx3 (addr, len, device) array that prep_xfer_dlist takes."""
        parts = []
        for r in self.regions:
            part = np.empty((r.rows, 3), dtype=np.uint64)
            part[:, 0] = base_addr + r.offset + np.arange(r.rows, dtype=np.uint64) * r.row_bytes
            part[:, 1] = r.row_bytes
            part[:, 2] = device_id
            parts.append(part)
        return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)


class BufferLayout:
    """The layout of one worker's buffer for its role; see the module docstring."""

    def __init__(self, config: TransportConfig, role: Role):
        self.config = config
        self.role = role
        self.num_slots = config.layers_in_flight * config.num_stages
        if config.elastic:
            # Any membership up to max_attention:max_ffn (issue 37): at most every rank of
            # the other role is a peer.
            self.num_peers = config.max_ffn if role is Role.ATTENTION else config.max_attention
        else:
            self.num_peers = max_peers(
                role, config.num_attention, config.num_ffn, groups=config.ffn_groups
            )
        hidden_row = config.hidden_size * config.itemsize
        router_row = config.router_width * config.router_itemsize
        max_rows = config.max_tokens_per_peer
        self._offset = 0

        if role is Role.ATTENTION:
            # Outputs come back from up to num_peers FFN ranks, each into its own area.
            self.recv_output = [
                [self._take(max_rows, hidden_row) for _ in range(self.num_peers)]
                for _ in range(self.num_slots)
            ]
            self.recv_bytes = _align(self._offset)
            self._offset = self.recv_bytes
            self.send_hidden = [self._take(max_rows, hidden_row) for _ in range(self.num_slots)]
            self.send_router = (
                [self._take(max_rows, router_row) for _ in range(self.num_slots)]
                if router_row
                else []
            )
        else:
            packed = self.num_peers * max_rows
            self.recv_hidden = [self._take(packed, hidden_row) for _ in range(self.num_slots)]
            self.recv_router = (
                [self._take(packed, router_row) for _ in range(self.num_slots)]
                if router_row
                else []
            )
            self.recv_bytes = _align(self._offset)
            self._offset = self.recv_bytes
            self.send_output = [self._take(packed, hidden_row) for _ in range(self.num_slots)]
        self.total_bytes = _align(self._offset)

    def _take(self, rows: int, row_bytes: int) -> Region:
        region = Region(self._offset, rows, row_bytes)
        self._offset = _align(self._offset + region.nbytes)
        return region

    def slot(self, layer: int, stage: int) -> int:
        lif = self.config.layers_in_flight
        return stage * lif + layer % lif

    # --- descriptor tables: region i of the table is slot i, router of slot i is i + slots ---

    def send_table(self) -> RowTable:
        """This worker's send staging, as the local side of its WRITEs."""
        if self.role is Role.ATTENTION:
            return RowTable(self.send_hidden + self.send_router)
        return RowTable(self.send_output)

    def recv_table_for(self, sender_pos: int) -> RowTable:
        """The part of this worker's receive area that the peer at ``sender_pos`` (its index in
        this worker's peer list) writes into: the remote side of that peer's WRITEs."""
        if self.role is Role.ATTENTION:
            return RowTable([areas[sender_pos] for areas in self.recv_output])
        # Every attention peer may land on any row of the packed area.
        return RowTable(self.recv_hidden + self.recv_router)


def peer_recv_table(
    mine: BufferLayout, peer: BufferLayout, sender_pos: int, peer_recv_bytes: int, where: str
) -> RowTable:
    """The part of ``peer``'s receive area that this worker (at ``sender_pos`` in the peer's
    peer list) writes into, listed in this worker's send-table order: region ``i`` of the
    result is where this worker's send region ``i`` lands. A stage the peer does not carry is
    an empty region (the step plan never sends it there). AfdBadInput if the peer's receive
    area is too small for its own layout."""
    table = peer.recv_table_for(sender_pos)
    last = table.regions[-1]
    if last.offset + last.nbytes > peer_recv_bytes:
        raise AfdBadInput(
            f"{where}: its receive region ({peer_recv_bytes} bytes) is smaller than the layout "
            "needs"
        )
    lif = mine.config.layers_in_flight
    peer_slots, my_slots = peer.num_slots, mine.num_slots
    regions: list[Region] = []
    # The sender's send table: its slots, then (attention with router columns) the same slots
    # again for the router; the receiver's table has the same two parts, sized by its slots.
    parts = len(mine.send_table().regions) // my_slots
    for part in range(parts):
        for slot in range(my_slots):
            stage = slot // lif
            if stage * lif >= peer_slots:
                row_bytes = table.regions[part * peer_slots].row_bytes
                regions.append(Region(0, 0, row_bytes))
            else:
                regions.append(table.regions[part * peer_slots + slot])
    return RowTable(regions)
