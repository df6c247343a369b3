"""Inbox: the notifications a worker received, filed until a receive takes them.

No NIXL here: the transport hands in what ``get_new_notifs`` returned, so these rules (epochs,
peers, duplicates, the caps, row counts) are unit-tested with plain bytes.

A notification is one of
* a probe: ignored;
* of an epoch newer than this worker's (or of any epoch before the first connect): kept aside
  and filed once ``enter_epoch`` reaches it (a peer may reconnect first);
* of an epoch this worker left: late traffic, dropped with an info line;
* of an epoch it never joined: ``AfdStaleEpoch``;
* otherwise it must come from a peer of this epoch, be the kind this role receives, name a
  configured stage, pass the endpoint's credit check (``screen``) and not be a duplicate:
  then it is filed as arrived, by (step, layer, stage, source rank), with its row count.
Every refusal raises ``AfdProtocolError`` (or ``AfdStaleEpoch``) and drops the message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from afd_ctl.routing import Role
from afd_data import notify
from afd_data.errors import AfdProtocolError, AfdStaleEpoch
from afd_data.notify import Kind, Notice

logger = logging.getLogger(__name__)

# (step, layer, stage, source role rank)
Key = tuple[int, int, int, int]


class Inbox:
    """The notifications of one worker; see the module docstring for what is kept."""

    def __init__(
        self,
        name: str,
        role: Role,
        role_rank: int,
        num_stages: int,
        expected: Kind,
        cap: int,
        screen: Callable[[Notice], None],
    ):
        self.name = name
        self.role = role
        self.role_rank = role_rank
        self.num_stages = num_stages
        self.expected = expected
        self.cap = cap
        self._screen = screen
        self.epoch: int | None = None
        self.past_epochs: set[int] = set()
        self.arrived: dict[Key, int] = {}  # -> rows
        self.future: list[tuple[str, bytes]] = []  # notifications of a newer epoch
        self._senders: dict[str, int] = {}  # agent name -> role rank, this epoch's peers
        self._labels: list[str] = []

    # ------------------------------------------------------------------ epochs

    def enter_epoch(self, epoch: int, senders: Mapping[str, int], labels: Sequence[str]) -> None:
        """Moves to ``epoch`` with these peers (agent name -> role rank; labels for messages)
        and files the notifications that arrived for it early."""
        if self.epoch is not None:
            self.past_epochs.add(self.epoch)
        self.epoch = epoch
        self._senders = dict(senders)
        self._labels = list(labels)
        self.arrived.clear()
        future, self.future = self.future, []
        for agent_name, msg in future:  # notifications that arrived before this epoch began
            try:
                self.absorb(agent_name, msg)
            except AfdProtocolError as e:
                logger.warning("dropped early notification: %s", e)

    def leave_epoch(self) -> None:
        """No epoch (a connect failed half way): what arrives next is kept for the next one."""
        if self.epoch is not None:
            self.past_epochs.add(self.epoch)
        self.epoch = None
        self._senders = {}
        self._labels = []
        self.arrived.clear()

    # ------------------------------------------------------------------ absorbing

    def absorb_all(self, notifs: Mapping[str, Iterable[bytes]]) -> None:
        """Files every notification; then raises the first refusal, if any (logged)."""
        error: Exception | None = None
        for agent_name, msgs in notifs.items():
            for msg in msgs:
                try:
                    self.absorb(agent_name, msg)
                except AfdProtocolError as e:
                    error = error or e
        if error is not None:
            logger.warning("data plane %s: %s", self.name, error)
            raise error

    def absorb(self, agent_name: str, msg: bytes) -> None:
        """Files one notification as arrived, or raises AfdProtocolError (message dropped)."""
        n = notify.unpack(msg, agent_name)
        if n.kind is Kind.PROBE:
            return
        epoch = self.epoch
        if epoch is None or n.epoch > epoch:
            if len(self.future) >= self.cap:
                raise AfdProtocolError(
                    f"{n.describe()} from agent {agent_name!r}: too many notifications for "
                    f"epochs newer than {epoch}; reconnect() with the new view"
                )
            self.future.append((agent_name, msg))
            return
        if n.epoch < epoch:
            if n.epoch in self.past_epochs:
                # Late traffic of an epoch this transport left: obsolete, not an error.
                logger.info("data plane %s: dropped late %s", self.name, n.describe())
                return
            raise AfdStaleEpoch(
                f"{n.describe()} from agent {agent_name!r} is for epoch {n.epoch}, which this "
                f"transport never joined (it is at epoch {epoch}); dropped: the sender must "
                "reconnect() with the control plane's current view"
            )
        if self._senders.get(agent_name) != n.src_rank or n.kind is not self.expected:
            raise AfdProtocolError(
                f"{n.describe()} from agent {agent_name!r}: not a {self.role.other.label} peer "
                f"of {self.role.label} rank {self.role_rank} in epoch {epoch} (peers "
                f"{self._labels}); dropped"
            )
        if n.stage >= self.num_stages:
            raise AfdProtocolError(
                f"{n.describe()}: stage {n.stage} but num_stages is {self.num_stages}"
            )
        self._screen(n)
        key = (n.step, n.layer, n.stage, n.src_rank)
        if key in self.arrived:
            raise AfdProtocolError(f"{n.describe()}: duplicate, dropped")
        if len(self.arrived) >= self.cap:
            raise AfdProtocolError(
                f"{n.describe()}: more than {self.cap} notifications waiting to be "
                "received; the sender runs ahead of begin_step/recv calls"
            )
        self.arrived[key] = n.rows

    # ------------------------------------------------------------------ taking

    def purge_before(self, step: int) -> int:
        """At begin_step: drops what arrived for earlier steps and was never taken."""
        stale = [k for k in self.arrived if k[0] < step]
        for k in stale:
            del self.arrived[k]
        if stale:
            logger.warning(
                "data plane %s: dropped %d unconsumed notification(s) of steps before %d",
                self.name,
                len(stale),
                step,
            )
        return len(stale)

    def complete(self, keys: Sequence[Key]) -> bool:
        arrived = self.arrived
        return all(k in arrived for k in keys)

    def take(
        self, keys: Sequence[Key], expect: Mapping[int, int], counts: Sequence[int], what: str
    ) -> None:
        """Takes the arrived ``keys`` (all present) and checks each peer's row count against
        the step's plan (``expect``: rank -> rows; ``counts``: the stage's DP token counts)."""
        arrived = self.arrived
        wrong = [(k[3], arrived[k]) for k in keys if arrived[k] != expect[k[3]]]
        for k in keys:
            del arrived[k]
        if wrong:
            step, layer, stage, _ = keys[0]
            rank, rows = wrong[0]
            raise AfdProtocolError(
                f"{self.role.other.label} rank {rank} sent {rows} rows of {what} for step {step} "
                f"layer {layer} stage {stage}, but this step's DP metadata says {expect[rank]} "
                f"(num_tokens_across_dp {list(counts)}); both sides must call "
                "begin_step with the same payload"
            )
