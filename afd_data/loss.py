"""Loss: the first peer loss of a transport's epoch, which every later wait raises.

Kept apart from the waits (``afd_data.poller``) so the write queue, the poller and the
transport share one record without calling back into each other. A loss names the epoch and
step it happened in, read from the inbox (epoch) and the credit count (step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from afd_data.credits import Credits
from afd_data.errors import AfdPeerLost
from afd_data.inbox import Inbox
from afd_data.peers import Peer

logger = logging.getLogger(__name__)


class Loss:
    """The first loss of the current epoch (``lost``), until the transport reconnects."""

    def __init__(self, name: str, inbox: Inbox, credits: Credits):
        self.name = name
        self._inbox = inbox
        self._credits = credits
        self.lost: AfdPeerLost | None = None
        # Called (on the thread that saw it) once per epoch, when the first loss is recorded.
        self.listeners: list[Callable[[], None]] = []

    def where(self) -> tuple[int | None, int | None]:
        """(epoch, step) that probes and losses name."""
        return self._inbox.epoch, self._credits.step

    def lose(self, peer: Peer, detail: str) -> AfdPeerLost:
        """Records the loss (every later call raises it until reconnect) and returns it."""
        if self.lost is None:
            epoch, step = self.where()
            self.lost = AfdPeerLost(
                f"{peer.label}: {detail} [epoch {epoch}, step {step}]",
                peer=f"{peer.spec.role.label}:{peer.spec.role_rank}",
                epoch=epoch,
            )
            logger.warning("data plane %s: %s", self.name, self.lost)
            self._tell()
        return self.lost

    def report(self, peer: str, detail: str) -> None:
        """A loss the control plane reported (any thread may call this); the first one stays."""
        if self.lost is None:
            epoch, _ = self.where()
            self.lost = AfdPeerLost(
                f"{detail} in epoch {epoch}; the step fails, and the worker reconnects by itself "
                "once afd-ctl reports the peer back (see `afd-ctl status`)",
                peer=peer,
                epoch=epoch,
            )
            logger.warning("data plane %s: %s", self.name, self.lost)
            self._tell()

    def _tell(self) -> None:
        for listener in self.listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not hide the loss
                logger.exception("data plane %s: a loss listener failed", self.name)
