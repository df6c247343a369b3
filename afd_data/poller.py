"""Poller: every wait of the transport, and the first loss of an epoch.

Without a NIXL progress thread nothing moves unless this process calls into NIXL, so a wait is
a loop of polls (spin briefly, yield, then short sleeps: ``afd_data.poll``), bounded by its
deadline. Peers awaited longer than ``probe_interval_s`` get a probe notification, so a dead
process surfaces as a NIXL disconnect long before the bound. The first loss is kept: every
later wait raises it until the transport reconnects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from afd_data import notify
from afd_data.agent import NIXL_ERRORS
from afd_data.config import TransportConfig
from afd_data.errors import AfdPeerLost
from afd_data.inbox import Inbox, Key
from afd_data.notify import Kind
from afd_data.peers import Peer
from afd_data.poll import Backoff, tighten_timer_slack

logger = logging.getLogger(__name__)


class Poller:
    """Polls (through ``poll``) until something is ready, probing awaited peers; keeps the
    loss. ``where`` returns the (epoch, step) that probes and losses name."""

    def __init__(
        self,
        name: str,
        agent: Any,
        config: TransportConfig,
        role_rank: int,
        poll: Callable[[bool], None],
        where: Callable[[], tuple[int | None, int | None]],
    ):
        self.name = name
        self._agent = agent
        self.config = config
        self.role_rank = role_rank
        self._poll = poll
        self._where = where
        self._backoff = Backoff(
            config.poll_spin_us * 1e-6, config.poll_sleep_us * 1e-6, config.poll_yield_us * 1e-6
        )
        self.lost: AfdPeerLost | None = None

    def wait(
        self,
        ready: Callable[[], bool],
        timeout_s: float,
        on_timeout: Callable[[], AfdPeerLost],
        awaited: Callable[[], list[Peer]],
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
            self._poll(False)
            if ready():
                return
            if self.lost is not None:
                raise self.lost
            now = time.monotonic()
            if now >= deadline:
                raise on_timeout()
            if now >= next_probe:
                self.probe(awaited())
                next_probe = now + interval
            backoff.pause(now)

    def await_arrivals(
        self, inbox: Inbox, keys: Sequence[Key], peers: Sequence[Peer], bound: float, what: str
    ) -> None:
        """Waits until ``keys`` (one per peer, in peer order) all arrived in ``inbox``; at the
        bound, the first missing peer is lost."""
        arrived = inbox.arrived

        def missing() -> list[Peer]:
            return [p for p, k in zip(peers, keys, strict=True) if k not in arrived]

        def on_timeout() -> AfdPeerLost:
            step, layer, stage, _ = keys[0]
            gone = missing()
            others = f" (also missing: {', '.join(p.label for p in gone[1:])})" if gone[1:] else ""
            return self.lose(
                gone[0],
                f"no {what} for step {step} layer {layer} stage {stage} within {bound} s"
                f"{others}; the peer is dead or stuck: wait for the control plane's new "
                "epoch and reconnect()",
            )

        self.wait(lambda: inbox.complete(keys), bound, on_timeout, missing)

    def probe(self, peers: list[Peer]) -> None:
        """A tiny notification to each awaited peer: NIXL raises a disconnect for a dead one."""
        epoch, step = self._where()
        msg = notify.pack(Kind.PROBE, epoch or 0, step or 0, 0, 0, self.role_rank, 0)
        for peer in {id(p): p for p in peers}.values():
            try:
                self._agent.send_notif(peer.agent_name, msg)
            except NIXL_ERRORS as e:
                raise self.lose(peer, f"disconnected ({type(e).__name__} {e})") from None

    def lose(self, peer: Peer, detail: str) -> AfdPeerLost:
        """Records the loss (every later call raises it until reconnect) and returns it."""
        if self.lost is None:
            epoch, step = self._where()
            self.lost = AfdPeerLost(
                f"{peer.label}: {detail} [epoch {epoch}, step {step}]",
                peer=f"{peer.spec.role.label}:{peer.spec.role_rank}",
                epoch=epoch,
            )
            logger.warning("data plane %s: %s", self.name, self.lost)
        return self.lost

    def report(self, peer: str, detail: str) -> None:
        """A loss the control plane reported (any thread may call this); the first one stays."""
        if self.lost is None:
            epoch, _ = self._where()
            self.lost = AfdPeerLost(
                f"{detail} in epoch {epoch}; reconnect() with the new epoch's peers",
                peer=peer,
                epoch=epoch,
            )
            logger.warning("data plane %s: %s", self.name, self.lost)
