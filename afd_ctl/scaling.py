"""Planned membership changes (`afd-ctl scale`, issue 37) and the epoch history. Plain Python.

A change moves the daemon from its topology to a target in three steps, so that nothing in
flight is lost and serving pauses only for the last one:

1. GATHER: the current epoch keeps serving. Workers the target adds register as pending (no
   epoch moves); workers it drops are told they are leaving: a leaving attention worker stops
   taking requests, finishes its own, and says `drained`.
2. FENCE, once every target slot is held and every leaving attention worker drained: every
   routed attention worker finishes the step in flight and says `fenced` (it holds between
   steps). An FFN worker needs nothing: an attention step ends only once its FFN outputs are
   back, so when every attention worker has fenced no FFN worker has a step in flight.
3. SWITCH, once every routed attention worker fenced: leaving workers are retired (RETIRED),
   the target becomes the topology in a new epoch (SCALED) and attention workers reconnect to
   its routing. The pause is fence to SWITCH plus their reconnect.

One change at a time: a scale while one is in progress is refused (never queued: an operator
who asked for 2:2 and then 3:2 should see the first land, or cancel it, before the second),
except a scale back to the current topology, which cancels a change still gathering. A fence
that does not complete within `fence_timeout_s` gives the change up (CHANGE_ABORTED) and the
current epoch serves on; so does a worker that cannot follow one (it never says `fenced`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from afd_ctl.errors import ControlError
from afd_ctl.membership import ATTENTION, ROLES, Membership, Worker
from afd_ctl.topology import Topology
from afd_ctl.v1 import afd_pb2

log = logging.getLogger(__name__)

Event = afd_pb2.MembershipEvent
HISTORY = 32  # epochs kept for status


class Phase(enum.IntEnum):
    GATHER = afd_pb2.ScaleChange.GATHER
    FENCE = afd_pb2.ScaleChange.FENCE


@dataclass
class Change:
    """The planned change in progress."""

    target: Topology
    reason: str
    started_at_s: float
    started_mono: float
    phase: Phase = Phase.GATHER
    fence_epoch: int = 0
    fence_at_s: float = 0.0
    fence_mono: float = 0.0
    # Worker ids that said `drained` / `fenced` (the latter in fence_epoch).
    drained: set[str] = field(default_factory=set)
    fenced: set[str] = field(default_factory=set)
    # Fenced senders whose last step (the value) has not reached the daemon yet: the Publish
    # stream and the Session are two streams, so `fenced` can overtake the last payload.
    fenced_after: dict[str, int] = field(default_factory=dict)


Announce = Callable[[afd_pb2.MembershipEvent.Kind, Worker | None, str], None]


class Scaling:
    """Drives one planned change at a time over `membership`. `announce(kind, worker, reason)`
    tells every worker (the controller's broadcast); `retire(worker, reason)` tells a leaving
    worker it is out and ends its place (no loss, no epoch)."""

    def __init__(
        self,
        membership: Membership,
        announce: Announce,
        retire: Callable[[Worker, str], None],
        fence_timeout_s: float = 10.0,
    ) -> None:
        self.membership = membership
        self.announce = announce
        self.retire = retire
        self.fence_timeout_s = fence_timeout_s
        self.change: Change | None = None
        self.last_result = ""
        self.last_pause_s = 0.0
        self.outcomes = {"scaled": 0, "aborted": 0, "cancelled": 0}
        self.history: deque[afd_pb2.EpochRecord] = deque(maxlen=HISTORY)
        self.note_epoch("daemon started")

    # -- the epoch history -----------------------------------------------------------------
    def note_epoch(self, reason: str, pause_s: float = 0.0) -> None:
        """Records the membership's epoch if it moved since the last record."""
        m = self.membership
        if self.history and self.history[-1].epoch == m.epoch:
            return
        self.history.append(
            afd_pb2.EpochRecord(
                epoch=m.epoch,
                at_s=time.time(),
                topology=m.topology.to_proto(),
                reason=reason,
                pause_s=pause_s,
                complete=m.complete,
            )
        )

    # -- asking ------------------------------------------------------------------------------
    def ask(self, attention: int, ffn: int, expert_parallel_size: int, reason: str) -> str:
        """`afd-ctl scale`: checks the target, starts the change; returns what happens next,
        one line. ControlError naming the rule or the worker when it cannot be done."""
        try:
            target = Topology.of(attention, ffn, expert_parallel_size)
        except ValueError as exc:
            raise ControlError(
                "INVALID_ARGUMENT", f"cannot scale to {attention}:{ffn}: {exc}"
            ) from None
        check_target(self.membership, target)
        return self.request(target, reason)[0]

    def request(self, target: Topology, reason: str) -> tuple[str, Topology | None]:
        """Starts a change to `target` (checked by the caller against the routing rules);
        returns what happens next and the target (None: nothing changes). ControlError when
        it cannot start now."""
        m, change = self.membership, self.change
        if change is not None:
            if target == m.topology and change.phase is Phase.GATHER:
                self.change, m.target = None, None
                self.outcomes["cancelled"] += 1
                self.last_result = f"cancelled: the change to {change.target.label} ({reason})"
                log.info("scale: %s", self.last_result)
                self.announce(Event.TARGET_SET, None, f"change cancelled: {reason}")
                return f"cancelled the change to {change.target.label}", None
            if target == change.target:
                return f"already moving to {target.label}: {self.describe_wait()}", target
            raise ControlError(
                "FAILED_PRECONDITION",
                f"a change to {change.target.label} is in progress ({change.phase.name.lower()}"
                f", {time.monotonic() - change.started_mono:.1f} s: {self.describe_wait()}); "
                "one change at a time: wait for it (afd-ctl status), or scale to the current "
                f"{m.topology.label} to cancel it before its fence",
            )
        if target == m.topology:
            return f"nothing to change: the membership is {target.label}", None
        self.change = Change(target, reason, time.time(), time.monotonic())
        m.target = target
        log.info("scale: %s -> %s asked (%s)", m.topology.label, target.label, reason)
        self.announce(Event.TARGET_SET, None, f"scale to {target.label}: {reason}")
        self.advance()
        return f"moving to {target.label}: {self.describe_wait()}", target

    # -- workers' answers ----------------------------------------------------------------------
    def on_drained(self, worker: Worker) -> None:
        change = self.change
        if change is not None and self.membership.leaving(worker):
            change.drained.add(worker.worker_id)
            log.info("scale: %s drained", worker.describe())
            self.advance()

    def on_fenced(self, worker: Worker, epoch: int, last_step_id: int = 0) -> None:
        change = self.change
        if change is None or change.phase is not Phase.FENCE or epoch != change.fence_epoch:
            return
        if last_step_id > (worker.last_step_id or 0):
            change.fenced_after[worker.worker_id] = last_step_id
            return
        change.fenced_after.pop(worker.worker_id, None)
        change.fenced.add(worker.worker_id)
        self.advance()

    def on_relayed(self, sender: Worker) -> None:
        """A payload of `sender` was relayed: a `fenced` that overtook it counts now."""
        change = self.change
        if change is not None and sender.worker_id in change.fenced_after:
            self.on_fenced(sender, change.fence_epoch, change.fenced_after[sender.worker_id])

    def on_members_changed(self, why: str) -> None:
        """A join or loss (of a routed worker: the epoch moved; of a pending one: the target
        lost a worker): a fence in progress starts over, its holds were for another set."""
        change = self.change
        if change is not None and change.phase is Phase.FENCE:
            change.phase, change.fenced, change.fenced_after = Phase.GATHER, set(), {}
            self.announce(Event.TARGET_SET, None, f"fence restarted: {why}")
        self.advance()

    # -- progress --------------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """A change is at its fence: attention workers hold between steps."""
        return self.change is not None and self.change.phase is Phase.FENCE

    def waiting_for(self) -> list[str]:
        """What the change waits for, one line each (empty: nothing, or no change)."""
        change, m = self.change, self.membership
        if change is None:
            return []
        lines = [
            f"{role.lower()} rank {rank} to register" for role, rank in m.missing(change.target)
        ]
        for worker in m.workers:
            if (
                worker.role == ATTENTION
                and m.routed(worker)
                and m.leaving(worker)
                and worker.worker_id not in change.drained
            ):
                lines.append(f"{worker.describe()} to drain its requests")
        if change.phase is Phase.FENCE:
            lines += [f"{w.describe()} to hold" for w in self._unfenced()]
        return lines

    def describe_wait(self) -> str:
        waiting = self.waiting_for()
        return "waiting for " + ", ".join(waiting) if waiting else "ready"

    def _unfenced(self) -> list[Worker]:
        assert self.change is not None
        m, fenced = self.membership, self.change.fenced
        return [
            w
            for w in m.workers
            if w.role == ATTENTION and m.routed(w) and w.worker_id not in fenced
        ]

    def advance(self) -> None:
        """Moves the change on as far as the workers allow."""
        change, m = self.change, self.membership
        if change is None:
            return
        if change.phase is Phase.GATHER:
            if self.waiting_for():
                return
            change.phase, change.fenced, change.fenced_after = Phase.FENCE, set(), {}
            change.fence_epoch = m.epoch
            change.fence_at_s, change.fence_mono = time.time(), time.monotonic()
            log.info("scale: fence at epoch %d for %s", m.epoch, change.target.label)
            self.announce(Event.FENCE, None, f"moving to {change.target.label}: hold")
        if change.phase is Phase.FENCE and not self._unfenced():
            self._switch(change)

    def _switch(self, change: Change) -> None:
        m = self.membership
        leaving = [w for w in m.workers if m.leaving(w)]
        old = m.apply_target()
        for worker in leaving:  # after: their view no longer routes them
            self.retire(worker, f"not in the new membership {m.topology.label}")
        self.change = None
        pause = time.monotonic() - change.fence_mono
        self.last_pause_s = pause
        self.outcomes["scaled"] += 1
        total = time.monotonic() - change.started_mono
        self.last_result = (
            f"scaled from {old.label} to {m.topology.label} at epoch {m.epoch}: held "
            f"{pause * 1e3:.0f} ms (fence to new epoch), {total:.1f} s since asked"
        )
        log.info("scale: %s; %d worker(s) retired", self.last_result, len(leaving))
        self.note_epoch(f"scaled to {m.topology.label}", pause_s=pause)
        self.announce(Event.SCALED, None, self.last_result)

    def tick(self) -> None:
        """Gives a fence up once it has lasted `fence_timeout_s` (call a few times a second)."""
        change = self.change
        if change is None or change.phase is not Phase.FENCE:
            return
        if time.monotonic() - change.fence_mono < self.fence_timeout_s:
            return
        late = ", ".join(w.describe() for w in self._unfenced())
        self.abort(
            f"{late} did not hold within {self.fence_timeout_s:.0f} s of the fence "
            "(--fence-timeout-s; a worker that cannot follow a scale never does)"
        )

    def abort(self, why: str) -> None:
        change, m = self.change, self.membership
        if change is None:
            return
        self.change, m.target = None, None
        self.outcomes["aborted"] += 1
        self.last_result = (
            f"aborted: the change to {change.target.label}: {why}; serving goes on at "
            f"{m.topology.label}"
        )
        log.warning("scale: %s", self.last_result)
        self.announce(Event.CHANGE_ABORTED, None, self.last_result)

    # -- status ------------------------------------------------------------------------------------
    def status(self) -> afd_pb2.ScaleChange | None:
        change = self.change
        if change is None:
            return None
        return afd_pb2.ScaleChange(
            target=change.target.to_proto(),
            phase=afd_pb2.ScaleChange.Phase.Name(int(change.phase)),
            started_at_s=change.started_at_s,
            fence_at_s=change.fence_at_s,
            waiting_for=self.waiting_for(),
            reason=change.reason,
        )


def check_target(membership: Membership, target: Topology) -> None:
    """ControlError naming the worker when a registered worker cannot serve in `target`: it
    does not follow planned changes at all, its attention TP group does not divide M, or its
    data plane was sized for fewer ranks."""
    for worker in membership.workers:
        spec = worker.spec
        if not spec.follows_scale:
            raise ControlError(
                "FAILED_PRECONDITION",
                f"{worker.describe()} cannot follow a planned change (it does not hold at a "
                "fence, drain or reconnect to a new epoch; a vLLM worker does once started "
                "with afd max_attention / max_ffn, README: Elastic membership): restart "
                f"the deployment at {target.attention}:{target.ffn} instead",
            )
        problem = target.lockstep_problem(spec.lockstep_size) if worker.role == ATTENTION else None
        if problem is not None:
            raise ControlError("INVALID_ARGUMENT", f"cannot scale: {problem}")
        if worker.role == ATTENTION and target.attention % spec.tp_size:
            raise ControlError(
                "INVALID_ARGUMENT",
                f"{target.attention} attention ranks is not a multiple of the TP size "
                f"{spec.tp_size} of {worker.describe()} (rule: M is a multiple of the "
                "attention TP size)",
            )
        for role, most in zip(ROLES, (spec.max_attention, spec.max_ffn), strict=True):
            if most and target.count(role) > most:
                raise ControlError(
                    "FAILED_PRECONDITION",
                    f"{worker.describe()} cannot follow {target.label}: its data plane was "
                    f"sized for at most {most} {role.lower()} rank(s) when it started; start "
                    "the workers sized for the largest membership you will scale to (README: "
                    "Elastic membership)",
                )
