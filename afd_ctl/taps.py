"""Operators' live streams of what the daemon relays (`afd-ctl watch`, the Tap RPC).

Each tap has its own queue, as long as a worker's (--subscriber-queue); a tap that falls that
far behind is cut off with RESOURCE_EXHAUSTED instead of slowing the relay. Plain Python: the
servicer drains each tap's mailbox onto its stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from afd_ctl.mailbox import Mailbox
from afd_ctl.v1 import afd_pb2

log = logging.getLogger(__name__)


@dataclass
class Tap:
    mailbox: Mailbox[afd_pb2.TapEvent]
    include_payloads: bool
    peer: str = ""


class Taps:
    def __init__(self, queue: int) -> None:
        self.queue = queue
        self._open: list[Tap] = []

    def __iter__(self) -> Iterator[Tap]:
        return iter(list(self._open))

    def __len__(self) -> int:
        return len(self._open)

    def add(self, include_payloads: bool, peer: str = "") -> Tap:
        tap = Tap(Mailbox(self.queue), include_payloads, peer)
        self._open.append(tap)
        return tap

    def remove(self, tap: Tap) -> None:
        if tap in self._open:
            self._open.remove(tap)

    def offer(self, event: afd_pb2.TapEvent, payloads: bool) -> None:
        """Queues `event` on every tap that wants it (payloads only where asked for)."""
        for tap in list(self._open):
            if payloads and not tap.include_payloads:
                continue
            if not tap.mailbox.offer(event):
                reason = (
                    f"tap fell behind: {tap.mailbox.capacity} events queued and unread "
                    "(--subscriber-queue); cut off"
                )
                log.warning("tap from %s cut off: %s", tap.peer, reason)
                tap.mailbox.close("RESOURCE_EXHAUSTED", reason, discard=True)
                self._open.remove(tap)
