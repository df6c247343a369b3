"""Poller: every wait of the transport, and the one poll they all repeat.

Without a NIXL progress thread nothing moves unless this process calls into NIXL, so a wait is
a loop of polls (spin briefly, yield, then short sleeps: ``afd_data.poll``), bounded by its
deadline. One poll (``progress``) takes the notifications that arrived into the inbox and
reaps the write queue's completed WRITEs. Peers awaited longer than ``probe_interval_s`` get a
probe notification, so a dead process surfaces as a NIXL disconnect long before the bound. The
first loss is kept in ``afd_data.loss``: every later wait raises it until the transport
reconnects.

A bound counts only time this process was polling: a gap between two polls longer than
``STALL_GAP_S`` (the process frozen, swapped out or starved of the CPU) moves the deadline on
by the gap, up to ``MAX_STALL_CREDIT_S`` in all, so a waiter that was itself stopped does not
blame a peer whose answer arrived meanwhile (over TCP it arrives only once this process polls).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from afd_data import notify
from afd_data.agent import NIXL_ERRORS
from afd_data.config import TransportConfig
from afd_data.errors import AfdPeerLost
from afd_data.inbox import Inbox, Key
from afd_data.loss import Loss
from afd_data.notify import Kind
from afd_data.peers import Peer
from afd_data.poll import Backoff, tighten_timer_slack
from afd_data.write_queue import WriteQueue

# A gap between two polls longer than this is the waiter's own stall, not the peer's delay.
STALL_GAP_S = 0.05
# The most a wait's deadline moves on for the waiter's stalls: every wait still ends.
MAX_STALL_CREDIT_S = 10.0


class Poller:
    """Polls NIXL (notifications into ``inbox``, completions out of ``queue``) until
    something is ready, probing awaited peers; a loss goes to ``loss``."""

    def __init__(
        self,
        name: str,
        agent: Any,
        config: TransportConfig,
        role_rank: int,
        inbox: Inbox,
        queue: WriteQueue,
        loss: Loss,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self._clock = clock
        self._agent = agent
        self.config = config
        self.role_rank = role_rank
        self._inbox = inbox
        self._queue = queue
        self._loss = loss
        self._backoff = Backoff(
            config.poll_spin_us * 1e-6, config.poll_sleep_us * 1e-6, config.poll_yield_us * 1e-6
        )

    def progress(self, raise_lost: bool = True) -> None:
        """One poll: raises a pending loss, takes notifications, reaps completed WRITEs."""
        if raise_lost and self._loss.lost is not None:
            raise self._loss.lost
        notifs = self._agent.get_new_notifs()
        if notifs:
            self._inbox.absorb_all(notifs)
        if self._queue.inflight:
            self._queue.reap()

    def wait(
        self,
        ready: Callable[[], bool],
        timeout_s: float,
        on_timeout: Callable[[], AfdPeerLost],
        awaited: Callable[[], list[Peer]],
    ) -> None:
        """Polls NIXL until ``ready()``; probes awaited peers; raises on_timeout() at the bound
        (counting only time this process was polling: see the module's docstring)."""
        clock = self._clock
        now = clock()
        deadline = now + timeout_s
        credit = MAX_STALL_CREDIT_S
        polled = now
        interval = self.config.probe_interval_s
        next_probe = now + interval
        backoff = self._backoff
        backoff.reset(now)
        tighten_timer_slack()
        while True:
            # What already arrived is delivered even when the peer was reported lost since
            # (it finished its last step and exited): take notifications first.
            self.progress(False)
            if ready():
                return
            if self._loss.lost is not None:
                raise self._loss.lost
            now = clock()
            if now - polled > STALL_GAP_S and credit > 0.0:
                moved = min(now - polled, credit)
                deadline += moved
                credit -= moved
            polled = now
            if now >= deadline:
                raise on_timeout()
            if now >= next_probe:
                self.probe(awaited())
                next_probe = now + interval
                polled = clock()  # time in a probe of the awaited peer is not this process's stall
            backoff.pause(now)

    def await_arrivals(
        self, keys: Sequence[Key], peers: Sequence[Peer], bound: float, what: str
    ) -> None:
        """Waits until ``keys`` (one per peer, in peer order) all arrived in the inbox; at the
        bound, the first missing peer is lost."""
        inbox = self._inbox
        arrived = inbox.arrived

        def missing() -> list[Peer]:
            return [p for p, k in zip(peers, keys, strict=True) if k not in arrived]

        def on_timeout() -> AfdPeerLost:
            step, layer, stage, _ = keys[0]
            gone = missing()
            others = f" (also missing: {', '.join(p.label for p in gone[1:])})" if gone[1:] else ""
            return self._loss.lose(
                gone[0],
                f"no {what} for step {step} layer {layer} stage {stage} within {bound} s"
                f"{others}; the peer is dead or stuck: wait for the control plane's new "
                "epoch and reconnect()",
            )

        self.wait(lambda: inbox.complete(keys), bound, on_timeout, missing)

    def await_slot(self, slot: int) -> None:
        """Waits until no local WRITE still reads send staging slot ``slot``."""
        queue = self._queue
        if queue.slot_busy[slot]:
            self.wait(
                lambda: not queue.slot_busy[slot],
                self.config.transfer_timeout_s,
                lambda: queue.timeout_loss(f"reusing send slot {slot}"),
                lambda: [x[1] for x in queue.inflight if x[2] == slot],
            )

    def await_all(self, timeout_s: float | None) -> None:
        """Waits until every WRITE posted has completed locally (flush)."""
        queue = self._queue
        if not queue.inflight:
            return
        self.wait(
            lambda: not queue.inflight,
            self.config.transfer_timeout_s if timeout_s is None else timeout_s,
            lambda: queue.timeout_loss("flush"),
            lambda: [x[1] for x in queue.inflight],
        )

    def probe(self, peers: list[Peer]) -> None:
        """A tiny notification to each awaited peer: NIXL raises a disconnect for a dead one."""
        epoch, step = self._loss.where()
        msg = notify.pack(Kind.PROBE, epoch or 0, step or 0, 0, 0, self.role_rank, 0)
        for peer in {id(p): p for p in peers}.values():
            try:
                self._agent.send_notif(peer.agent_name, msg)
            except NIXL_ERRORS as e:
                raise self._loss.lose(peer, f"disconnected ({type(e).__name__} {e})") from None
