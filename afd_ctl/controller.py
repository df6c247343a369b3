"""The daemon's state and behaviour, free of gRPC.

`Controller` owns the membership, one outgoing mailbox per worker session and per tap, and the
step relay: it validates each published payload and fans it out to the FFN workers its sender
serves. Messages are protobuf objects; the servicer only moves them on and off the wire.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable

from afd_ctl.config import DaemonConfig
from afd_ctl.daemon_views import daemon_view, status_of, view_for, worker_info
from afd_ctl.errors import ControlError
from afd_ctl.fan_out import FanOut
from afd_ctl.mailbox import Mailbox
from afd_ctl.membership import ATTENTION, FFN, Membership, Worker, WorkerSpec
from afd_ctl.scaling import Scaling
from afd_ctl.sessions import Session, end_session, publishing_session
from afd_ctl.taps import Taps
from afd_ctl.timing_book import TimingBook
from afd_ctl.trace import PendingTrace
from afd_ctl.v1 import afd_pb2
from afd_ctl.validation import validate_payload

log = logging.getLogger(__name__)

Event = afd_pb2.MembershipEvent
RECENT_EVENTS = 20


class Controller:
    def __init__(self, config: DaemonConfig, first_epoch: int | None = None) -> None:
        self.config = config
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.monotonic()
        self.membership = Membership(
            config.expect_attention,
            config.expect_ffn,
            config.max_blob_bytes,
            first_epoch,
            ffn_groups=config.ffn_groups,
        )
        self.sessions: dict[str, Session] = {}
        self.taps = Taps(config.subscriber_queue)
        # The last RECENT_EVENTS membership changes, for status (what happened, and why).
        self.recent_events: deque[afd_pb2.MembershipEvent] = deque(maxlen=RECENT_EVENTS)
        self.draining = False
        # The attention side published `stop` since the set was last complete.
        self.stop_relayed = False
        self.steps_relayed = 0
        self.payloads_rejected = 0
        self.last_step_id = 0
        self.last_payload_at = 0.0
        self.health_listeners: list[Callable[[str], None]] = []
        # The address actually bound (the configured one may say port 0).
        self.listen_address = config.listen
        self.fan_out = FanOut()
        # Issue 26: each reporting worker's rolling window, and the trace being recorded.
        self.timing = TimingBook(self.membership.ffn_groups)
        # Issue 37: planned membership changes (afd-ctl scale) and the epoch history.
        self.scaling = Scaling(
            self.membership, self._announce, self._retire, config.fence_timeout_s
        )

    # -- health --------------------------------------------------------------------------
    @property
    def health(self) -> str:
        if self.draining:
            return "DRAINING"
        return "SERVING" if self.membership.complete else "NOT_SERVING"

    def _health_changed(self) -> None:
        health = self.health
        for listener in self.health_listeners:
            listener(health)

    # -- sessions ------------------------------------------------------------------------
    def open_session(self, spec: WorkerSpec, peer: str) -> Session:
        if self.draining:
            raise ControlError("UNAVAILABLE", "the daemon is draining and refuses registrations")
        was_complete = self.membership.complete
        worker = self.membership.join(spec, peer)
        session = Session(
            worker, Mailbox(self.config.subscriber_queue), publish_secret=secrets.token_hex(16)
        )
        self.sessions[worker.worker_id] = session
        log.info(
            "worker registered: %s from %s, epoch %d (%d/%d attention, %d/%d ffn)",
            worker.describe(),
            peer,
            self.membership.epoch,
            self.membership.count(ATTENTION),
            self.membership.expected[ATTENTION],
            self.membership.count(FFN),
            self.membership.expected[FFN],
        )
        registered = afd_pb2.Registered(
            worker=worker_info(worker),
            view=self.view_for(worker),
            is_sender=self.membership.is_sender(worker),
            publish_secret=session.publish_secret,
        )
        session.mailbox.offer(afd_pb2.SessionMessage(registered=registered))
        self._broadcast(Event.PEER_JOINED, worker, "registered", skip=worker)
        if self.membership.complete and not was_complete:
            self.stop_relayed = False
            log.info("expected set complete, epoch %d: SERVING", self.membership.epoch)
            self._broadcast(Event.SET_COMPLETE, None, "all expected workers registered")
        self._epoch_moved(f"{worker.describe()} registered", worker)
        self._health_changed()
        return session

    def _epoch_moved(self, why: str, worker: Worker) -> None:
        """A join or loss: recorded in the epoch history if it moved the epoch (a pending
        worker's does not), and a planned change moves on (or restarts its fence)."""
        if self.membership.routed(worker):
            self.scaling.note_epoch(why)
            self.scaling.on_members_changed(why)
        else:
            self.scaling.advance()

    def close_session(self, session: Session, reason: str) -> None:
        """The session's stream ended (hang-up, keepalive failure, cut-off)."""
        worker = session.worker
        session.ended = True
        if self.sessions.get(worker.worker_id) is session:
            del self.sessions[worker.worker_id]
            self.timing.forget(worker.worker_id)
        session.mailbox.close("CANCELLED", reason, discard=True)
        if not self.membership.leave(worker, reason):
            return
        if not self.membership.routed(worker):  # a pending worker of a change: no loss
            log.info("pending %s left: %s", worker.describe(), reason)
            self.scaling.on_members_changed(f"pending {worker.describe()} left: {reason}")
            return
        # After a stop (a drain, or the attention side's stop payload) workers leaving is the
        # plan, not a loss to warn about.
        level = logging.INFO if self.draining or self.stop_relayed else logging.WARNING
        log.log(
            level, "peer lost: %s: %s; epoch %d", worker.describe(), reason, self.membership.epoch
        )
        self._broadcast(Event.PEER_LOST, worker, reason)
        self._epoch_moved(f"{worker.describe()} lost: {reason}", worker)
        self._health_changed()

    def _cut_off(self, session: Session, reason: str) -> None:
        session.mailbox.close("RESOURCE_EXHAUSTED", reason, discard=True)
        self.close_session(session, reason)

    # -- the step relay ------------------------------------------------------------------
    def publisher(self, worker_id: str, secret: str) -> Session:
        """The session a new Publish stream acts for (afd_ctl/sessions.py)."""
        return publishing_session(self.sessions, worker_id, secret)

    def publish(self, session: Session, payload: afd_pb2.AFDControlPayload) -> None:
        """Validates `payload` from the worker of `session` (see `publisher`) and queues it for
        its FFN subscribers."""
        try:
            if session.ended:
                raise ControlError(
                    "FAILED_PRECONDITION",
                    f"the session of {session.worker.describe()} that this publish stream was "
                    "opened for has ended; open a new stream with the secret of the new "
                    "registration",
                    "SESSION_ENDED",
                )
            sender = session.worker
            validate_payload(
                payload,
                sender=sender,
                is_sender=self.membership.is_sender(sender),
                epoch=self.membership.epoch,
                attention_dp_size=self.membership.attention_dp_size,
            )
            if not self.membership.complete and not payload.stop:
                raise ControlError(
                    "UNAVAILABLE",
                    f"the expected set is incomplete at epoch {self.membership.epoch}: "
                    "wait for SET_COMPLETE before publishing",
                    "SET_INCOMPLETE",
                )
        except ControlError:
            self.payloads_rejected += 1
            raise
        sender.last_step_id = payload.step_id
        self.last_step_id = payload.step_id
        self.last_payload_at = time.monotonic()
        self.timing.on_payload(sender, payload)
        if payload.stop:
            self.stop_relayed = True
        self.steps_relayed += 1
        message = afd_pb2.SessionMessage(payload=payload)
        for mailbox in self.fan_out.targets(sender, self.membership, self.sessions):
            if mailbox.offer(message):
                mailbox.last_step_id = payload.step_id
            else:
                self._cut_off_mailbox(mailbox)
        if self.taps:
            self.taps.offer(afd_pb2.TapEvent(payload=payload), payloads=True)
        if self.scaling.change is not None:
            self.scaling.on_relayed(sender)

    def _cut_off_mailbox(self, mailbox: Mailbox[afd_pb2.SessionMessage]) -> None:
        for session in list(self.sessions.values()):
            if session.mailbox is mailbox:
                self._cut_off(
                    session,
                    f"fell behind: {mailbox.capacity} messages queued and unread "
                    f"(--subscriber-queue; last delivered step {mailbox.last_step_id}); cut off",
                )

    # -- step timings and traces (issue 26; kept in afd_ctl/timing_book.py) ----------------
    def record_timings(self, session: Session, report: afd_pb2.StepTimings) -> bool:
        """A worker's StepTimings; False when refused (counted)."""
        if session.ended:
            return False
        return self.timing.record(session.worker, report)

    def record_trace(self, session: Session, spans: afd_pb2.TraceSpans, received_at: float) -> None:
        if not session.ended:
            self.timing.take_spans(session.worker.worker_id, spans, received_at)

    def acknowledge(self, session: Session, request: afd_pb2.SessionRequest) -> None:
        """A worker's `drained` or `fenced` (issue 37)."""
        if session.ended:
            return
        if request.WhichOneof("message") == "drained":
            self.scaling.on_drained(session.worker)
        else:
            fenced = request.fenced
            self.scaling.on_fenced(session.worker, fenced.epoch, fenced.last_step_id)

    def start_trace(self, steps: int) -> PendingTrace:
        """Asks every worker that reports timings (only those know TraceStart) to record the
        next `steps` steps."""
        if not self.membership.complete:
            raise ControlError(
                "FAILED_PRECONDITION",
                "the expected set is incomplete: no steps run to trace (afd-ctl status)",
            )
        asked = {
            worker_id: worker_info(session.worker)
            for worker_id, session in self.sessions.items()
            if self.timing.reporting(worker_id)
        }
        trace, start = self.timing.start_trace(steps, asked, self.last_step_id)
        for worker_id in asked:
            self.sessions[worker_id].mailbox.offer(afd_pb2.SessionMessage(trace_start=start))
        return trace

    # -- events --------------------------------------------------------------------------
    def _broadcast(
        self,
        kind: afd_pb2.MembershipEvent.Kind,
        worker: Worker | None,
        reason: str,
        skip: Worker | None = None,
    ) -> None:
        info = worker_info(worker) if worker is not None else None
        at_s = time.time()
        recent = Event(kind=kind, reason=reason, at_s=at_s, view=daemon_view(self))
        if info is not None:
            recent.worker.CopyFrom(info)
        self._record(recent)
        for session in list(self.sessions.values()):
            if session.worker is skip:
                continue
            event = Event(kind=kind, reason=reason, view=self.view_for(session.worker), at_s=at_s)
            if info is not None:
                event.worker.CopyFrom(info)
            if not session.mailbox.offer(afd_pb2.SessionMessage(event=event)):
                self._cut_off(session, "fell behind: membership event could not be queued")

    def _record(self, event: afd_pb2.MembershipEvent) -> None:
        """Into the recent events (status) and to the taps (afd-ctl watch)."""
        self.recent_events.append(event)
        if self.taps:
            self.taps.offer(afd_pb2.TapEvent(membership=event), payloads=False)

    # -- planned changes (issue 37; the steps are afd_ctl/scaling.py's) --------------------
    def scale(self, attention: int, ffn: int, expert_parallel_size: int, reason: str) -> str:
        """`afd-ctl scale`: a target membership; returns what happens next, in one line."""
        if self.draining:
            raise ControlError("UNAVAILABLE", "the daemon is draining: no membership change")
        return self.scaling.ask(attention, ffn, expert_parallel_size, reason)

    def _announce(
        self, kind: afd_pb2.MembershipEvent.Kind, worker: Worker | None, reason: str
    ) -> None:
        if kind == Event.SCALED:
            self.timing.groups = self.membership.ffn_groups
        self._broadcast(kind, worker, reason)
        self._health_changed()

    def _retire(self, worker: Worker, reason: str) -> None:
        """A leaving worker is out: RETIRED on its session, which then ends."""
        self.membership.retire(worker)
        session = self.sessions.pop(worker.worker_id, None)
        log.info("retired: %s (%s)", worker.describe(), reason)
        event = Event(kind=Event.RETIRED, reason=reason, view=self.view_for(worker))
        event.at_s = time.time()
        event.worker.CopyFrom(worker_info(worker))
        self._record(event)
        if session is not None:
            self.timing.forget(worker.worker_id)
            end_session(session, event)

    # -- drain ---------------------------------------------------------------------------
    def drain(self, reason: str, *, stop: bool) -> int:
        """Idempotent: refuse registrations and tell every worker; returns FFN workers told.

        With `stop` (afd-ctl stop) the deployment shuts down: STOP, on which FFN workers exit
        and attention workers stop serving until a daemon and FFN workers are back. Without
        (SIGTERM, SIGINT) the daemon is restarting: DAEMON_DRAINING, on which every worker
        hangs up and registers again with the next daemon (proto: MembershipEvent.Kind)."""
        if self.draining:
            return 0
        self.draining = True
        if stop:
            log.info("draining: %s; health NOT_SERVING, STOP sent to every worker", reason)
        else:
            log.info(
                "draining: %s; health NOT_SERVING, every worker told to register again with "
                "the next daemon (afd-ctl stop shuts a deployment down)",
                reason,
            )
        told = sum(1 for s in self.sessions.values() if s.worker.role == FFN)
        self._broadcast(Event.STOP if stop else Event.DAEMON_DRAINING, None, reason)
        self._health_changed()
        return told

    # -- views (afd_ctl/daemon_views.py) ----------------------------------------------------
    def view_for(self, worker: Worker) -> afd_pb2.View:
        return view_for(self.membership, self.incarnation, worker, self.scaling.holding)

    def status(self) -> afd_pb2.Status:
        return status_of(self)

    def list_workers(self, role: str | None) -> list[afd_pb2.WorkerInfo]:
        return [worker_info(w) for w in self.membership.workers if role in (None, w.role)]
