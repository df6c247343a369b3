"""WriteQueue: this worker's WRITEs, from posting to local completion.

The transfer handle for a (slot, local row, remote row, rows) is prepared once per peer from
the descriptor lists built at connect (one descriptor per row, so a transfer only picks
indices) and re-posted afterwards; at most ``handles_per_peer`` are kept, least recently used
evicted, never one in flight. A WRITE not yet complete keeps its send staging slot busy: the
slot is rewritten only after the WRITEs out of it completed (the poller's ``await_slot``,
bounded). A WRITE that fails loses its peer (``afd_data.loss``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from afd_data.agent import NIXL_ERRORS
from afd_data.config import TransportConfig
from afd_data.errors import AfdBadInput, AfdPeerLost
from afd_data.layout import RowTable
from afd_data.loss import Loss
from afd_data.notify import Kind
from afd_data.peers import Peer

logger = logging.getLogger(__name__)


class WriteQueue:
    """Posted WRITEs still in flight, and the prepared handles of every peer."""

    def __init__(
        self,
        name: str,
        agent: Any,
        send_table: RowTable,
        send_dlist: Any,
        num_slots: int,
        config: TransportConfig,
        loss: Loss,
    ):
        self.name = name
        self._agent = agent
        self._send_table = send_table
        self._send_dlist = send_dlist
        self._num_slots = num_slots
        self.config = config
        self._loss = loss
        # Local WRITEs not yet complete: (handle, peer, slot); per-slot count.
        self.inflight: list[tuple[Any, Peer, int]] = []
        self.slot_busy = [0] * num_slots

    # ------------------------------------------------------------------ posting

    def post(
        self,
        peer: Peer,
        slot: int,
        regions: tuple[int, ...],
        local_row: int,
        remote_row: int,
        rows: int,
        msg: bytes,
        kind: Kind,
        layer: int,
        stage: int,
    ) -> None:
        """Posts one WRITE of ``rows`` rows (per region) with its notification ``msg``."""
        key = (slot, local_row, remote_row, rows)
        handle = peer.handles.get(key)
        if handle is None:
            handle = self._make_handle(peer, regions, local_row, remote_row, rows)
            peer.handles[key] = handle
            self._evict(peer)
        else:
            peer.handles.move_to_end(key)
        try:
            state = self._agent.transfer(handle, msg)
        except NIXL_ERRORS as e:
            raise self._loss.lose(
                peer,
                f"WRITE of {kind.name.lower()} layer {layer} stage {stage} "
                f"failed: {type(e).__name__} {e}",
            ) from None
        if state == "ERR":
            raise self._loss.lose(
                peer, f"WRITE of {kind.name.lower()} layer {layer} stage {stage} returned ERR"
            )
        if state != "DONE":
            self.inflight.append((handle, peer, slot))
            self.slot_busy[slot] += 1

    def _make_handle(
        self, peer: Peer, regions: tuple[int, ...], local_row: int, remote_row: int, rows: int
    ) -> Any:
        assert peer.table is not None
        # Once per handle, never on the hot path: a row range past its region (a stage the
        # peer does not carry is an empty region) would land in the next one.
        for r in regions:
            if remote_row + rows > peer.table.regions[r].rows:
                raise AfdBadInput(
                    f"{peer.label}: rows {remote_row}..{remote_row + rows} of region {r} "
                    f"exceed its {peer.table.regions[r].rows} rows (a stage it does not carry?)"
                )
        local = np.concatenate(
            [
                np.arange(rows, dtype=np.int32) + (self._send_table.start(r) + local_row)
                for r in regions
            ]
        )
        remote = np.concatenate(
            [np.arange(rows, dtype=np.int32) + (peer.table.start(r) + remote_row) for r in regions]
        )
        try:
            return self._agent.make_prepped_xfer(
                "WRITE", self._send_dlist, local, peer.dlist, remote, b""
            )
        except NIXL_ERRORS as e:
            raise self._loss.lose(
                peer, f"preparing a WRITE failed: {type(e).__name__} {e}"
            ) from None

    def _evict(self, peer: Peer) -> None:
        """Keeps at most handles_per_peer handles, never releasing one in flight."""
        excess = len(peer.handles) - self.config.handles_per_peer
        if excess <= 0:
            return
        busy = {id(h) for h, _, _ in self.inflight}
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
            except NIXL_ERRORS as e:
                logger.debug("release of an evicted handle failed: %s", e)

    # ------------------------------------------------------------------ completion

    def reap(self) -> None:
        """Drops the WRITEs that completed; a failed one loses its peer (raised)."""
        still = []
        for entry in self.inflight:
            handle, peer, slot = entry
            try:
                state = self._agent.check_xfer_state(handle)
            except NIXL_ERRORS as e:
                raise self._loss.lose(peer, f"WRITE failed: {type(e).__name__} {e}") from None
            if state == "DONE":
                self.slot_busy[slot] -= 1
            elif state == "ERR":
                raise self._loss.lose(peer, "WRITE failed (ERR)")
            else:
                still.append(entry)
        self.inflight = still

    def timeout_loss(self, what: str) -> AfdPeerLost:
        """The loss of a WRITE that did not complete in time (the poller's waits raise it)."""
        peer = self.inflight[0][1]
        return self._loss.lose(
            peer,
            f"a WRITE did not complete within {self.config.transfer_timeout_s} s ({what}); the "
            "peer is dead or stuck",
        )

    def settle(self) -> None:
        """Before a membership change: lets this side's WRITEs finish (bounded), so none of an
        old epoch lands after the new epoch's; failed or stuck ones are abandoned."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while self.inflight and time.monotonic() < deadline:
            still = []
            for entry in self.inflight:
                try:
                    state = self._agent.check_xfer_state(entry[0])
                except NIXL_ERRORS:
                    state = "ERR"
                if state == "PROC":
                    still.append(entry)
            self.inflight = still
            if still:
                time.sleep(self.config.poll_sleep_us * 1e-6)
        if self.inflight:
            logger.warning(
                "data plane %s: abandoning %d unfinished WRITE(s) at reconnect",
                self.name,
                len(self.inflight),
            )
        self.clear()

    def clear(self) -> None:
        """Forgets every WRITE in flight (settled, abandoned or the transport closed)."""
        self.inflight = []
        self.slot_busy = [0] * self._num_slots
