"""Where each sender's payloads go: the mailboxes of the FFN workers it serves, worked out once
per epoch (routing changes only with the epoch) and looked up per payload. Plain Python."""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd_ctl.mailbox import Mailbox
from afd_ctl.membership import Membership, Worker
from afd_ctl.v1 import afd_pb2

if TYPE_CHECKING:
    from afd_ctl.sessions import Session

Outbox = Mailbox[afd_pb2.SessionMessage]


class FanOut:
    def __init__(self) -> None:
        self._targets: dict[int, list[Outbox]] = {}
        self._epoch = -1

    def targets(
        self, sender: Worker, membership: Membership, sessions: dict[str, Session]
    ) -> list[Outbox]:
        """The mailboxes of `sender`'s FFN subscribers that have a live session."""
        if self._epoch != membership.epoch:
            self._targets.clear()
            self._epoch = membership.epoch
        targets = self._targets.get(sender.role_rank)
        if targets is None:
            targets = [
                sessions[w.worker_id].mailbox
                for w in membership.subscribers_of(sender)
                if w.worker_id in sessions
            ]
            self._targets[sender.role_rank] = targets
        return targets
