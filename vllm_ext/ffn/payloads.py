"""Where an FFN server's next step payload comes from: afd-ctl's relay and, from an attention
sender on the same host, the direct copy (afd_ctl.direct), whichever comes first.

Without direct senders in the view it is afd-ctl's `next_payload` as before. With them, the
server waits on both at once (the relay wakes the direct socket's wait) and afd_ctl.direct's
StepChain decides: every step runs once, in the order published; the relay's copy of a step
that ran from the direct path is skipped. Errors (a loss, a stop, afd-ctl unreachable) come
from the relay alone, as before.
"""

from __future__ import annotations

import time
from typing import Any

from afd_ctl.client import ControllerClient
from afd_ctl.direct import DirectInbox
from afd_ctl.errors import AfdTimeout


class Payloads:
    def __init__(
        self, client: ControllerClient, inbox: DirectInbox | None, poll_s: float = 0.0
    ) -> None:
        """`poll_s`: after a payload, look for the next direct one this long without sleeping
        (afd ffn_poll_s)."""
        self.client = client
        self.inbox = inbox
        self.poll_s = poll_s
        self.polls = 0  # looks without sleeping
        self.direct = 0  # steps taken from the direct path
        self.relayed = 0  # ... and from afd-ctl's relay
        self.skipped = 0  # relayed copies of steps that ran from the direct path
        self.taken_at = 0.0  # when `next` last returned a payload (monotonic)
        if inbox is not None:
            client.on_inbound(inbox.wake)

    def next(self, timeout_s: float, epoch: int) -> Any:
        """The next payload to run (its epoch may differ from `epoch`, the data plane's: the
        caller follows it), or a typed error as ControllerClient.next_payload raises one."""
        payload = self._next(timeout_s, epoch)
        self.taken_at = time.monotonic()
        return payload

    def _next(self, timeout_s: float, epoch: int) -> Any:
        inbox = self.inbox
        if inbox is None or not inbox.active:
            while True:
                only = self.client.next_payload(timeout_s=timeout_s)
                if inbox is None or inbox.chain.relayed(only):
                    self.relayed += not only.stop
                    return only
                self.skipped += 1  # a step that came directly before the view changed
        deadline = time.monotonic() + timeout_s
        while True:
            inbox.take()  # what came while the last step was being enqueued
            payload = inbox.chain.ready(epoch)
            if payload is not None:
                self.direct += 1
                return payload
            relayed = self.client.poll_payload()
            if relayed is not None:
                if inbox.chain.relayed(relayed):
                    self.relayed += not relayed.stop
                    return relayed
                self.skipped += 1
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                try:  # what a relay-only wait would raise (a lost set, afd-ctl unreachable)
                    return self._checked(self.client.next_payload(timeout_s=0.0))
                except AfdTimeout:
                    raise AfdTimeout(
                        f"no payload within {timeout_s:.3f} s, from afd-ctl or directly"
                    ) from None
            if self.poll_s and time.monotonic() - self.taken_at < self.poll_s:
                self.polls += 1
                inbox.wait(0.0)  # a look: the sender's send then wakes nobody
                continue
            inbox.wait(remaining)

    def _checked(self, payload: Any) -> Any:
        assert self.inbox is not None
        if self.inbox.chain.relayed(payload):
            self.relayed += not payload.stop
            return payload
        self.skipped += 1
        raise AfdTimeout("only a relayed copy of a step that already ran")

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = {
            "payloads_direct": self.direct,
            "payloads_relayed": self.relayed,
        }
        if self.inbox is not None:
            stats["payloads_direct_refused"] = self.inbox.refused
        if self.poll_s:
            stats["payload_polls"] = self.polls
        return stats
