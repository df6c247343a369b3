"""The daemon's state and behaviour, free of gRPC.

`Controller` owns the membership, one outgoing mailbox per worker session and per tap, and the
step relay: it validates each published payload and fans it out to the FFN workers its sender
serves. Messages are protobuf objects; the servicer only moves them on and off the wire.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from afd_ctl.config import DaemonConfig
from afd_ctl.daemon_views import status_of, view_for, worker_info
from afd_ctl.errors import ControlError
from afd_ctl.logs import clip
from afd_ctl.mailbox import Mailbox
from afd_ctl.membership import ATTENTION, FFN, Membership, Worker, WorkerSpec
from afd_ctl.taps import Taps
from afd_ctl.timing_book import TimingBook
from afd_ctl.trace import PendingTrace
from afd_ctl.v1 import afd_pb2
from afd_ctl.validation import validate_payload
from afd_ctl.wire import PUBLISH_SECRET_METADATA, WORKER_ID_METADATA

log = logging.getLogger(__name__)

Event = afd_pb2.MembershipEvent
RECENT_EVENTS = 20


@dataclass
class Session:
    worker: Worker
    mailbox: Mailbox[afd_pb2.SessionMessage]
    # Handed to the worker in its Registered answer; a Publish stream must show it (once, when
    # it opens) to act as this worker.
    publish_secret: str = ""
    # Set when the session ends: publish streams bound to it stop being accepted.
    ended: bool = False


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
        self._targets: dict[int, list[Mailbox[afd_pb2.SessionMessage]]] = {}
        self._targets_epoch = -1
        # Issue 26: each reporting worker's rolling window, and the trace being recorded.
        self.timing = TimingBook(self.membership.ffn_groups)

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
            worker=self.worker_info(worker),
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
        self._health_changed()
        return session

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
        # After a stop (a drain, or the attention side's stop payload) workers leaving is the
        # plan, not a loss to warn about.
        level = logging.INFO if self.draining or self.stop_relayed else logging.WARNING
        log.log(
            level, "peer lost: %s: %s; epoch %d", worker.describe(), reason, self.membership.epoch
        )
        self._broadcast(Event.PEER_LOST, worker, reason)
        self._health_changed()

    def _cut_off(self, session: Session, reason: str) -> None:
        session.mailbox.close("RESOURCE_EXHAUSTED", reason, discard=True)
        self.close_session(session, reason)

    # -- the step relay ------------------------------------------------------------------
    def publisher(self, worker_id: str, secret: str) -> Session:
        """The session a new Publish stream acts for: the one registered as `worker_id`, if
        `secret` is the one its registration was given. Checked once per stream, not per
        payload; the stream stays bound to that session and dies with it."""
        if not worker_id:
            raise ControlError(
                "INVALID_ARGUMENT",
                f"call metadata {WORKER_ID_METADATA!r} is missing: name the registered attention "
                "worker that publishes",
            )
        session = self.sessions.get(worker_id)
        if session is None:
            raise ControlError(
                "FAILED_PRECONDITION",
                f"{WORKER_ID_METADATA} {clip(worker_id)!r} has no live session; register first "
                "(or again, after it was lost)",
            )
        if not secret:
            raise ControlError(
                "PERMISSION_DENIED",
                f"call metadata {PUBLISH_SECRET_METADATA!r} is missing: only the client that "
                f"registered {clip(worker_id)!r} may publish as it, with the publish_secret of "
                "its Registered answer",
            )
        if not hmac.compare_digest(secret.encode(), session.publish_secret.encode()):
            raise ControlError(
                "PERMISSION_DENIED",
                f"{PUBLISH_SECRET_METADATA} is not the one issued to the session of "
                f"{clip(worker_id)!r}: only the client that registered a worker may publish as "
                "it (an old secret stops working when its session ends)",
            )
        return session

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
        for mailbox in self._targets_of(sender):
            if mailbox.offer(message):
                mailbox.last_step_id = payload.step_id
            else:
                self._cut_off_mailbox(mailbox)
        if self.taps:
            self.taps.offer(afd_pb2.TapEvent(payload=payload), payloads=True)

    def _targets_of(self, sender: Worker) -> list[Mailbox[afd_pb2.SessionMessage]]:
        if self._targets_epoch != self.membership.epoch:
            self._targets.clear()
            self._targets_epoch = self.membership.epoch
        targets = self._targets.get(sender.role_rank)
        if targets is None:
            targets = [
                self.sessions[w.worker_id].mailbox
                for w in self.membership.subscribers_of(sender)
                if w.worker_id in self.sessions
            ]
            self._targets[sender.role_rank] = targets
        return targets

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

    def start_trace(self, steps: int) -> PendingTrace:
        """Asks every worker that reports timings (only those know TraceStart) to record the
        next `steps` steps."""
        if not self.membership.complete:
            raise ControlError(
                "FAILED_PRECONDITION",
                "the expected set is incomplete: no steps run to trace (afd-ctl status)",
            )
        asked = {
            worker_id: self.worker_info(session.worker)
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
        info = self.worker_info(worker) if worker is not None else None
        at_s = time.time()
        recent = Event(kind=kind, reason=reason, at_s=at_s)
        if info is not None:
            recent.worker.CopyFrom(info)
        # The daemon's view at the change; peers are per worker, so none here.
        m = self.membership
        recent.view.epoch = m.epoch
        recent.view.complete = m.complete
        recent.view.controller_incarnation = self.incarnation
        recent.view.expected_attention = m.expected[ATTENTION]
        recent.view.expected_ffn = m.expected[FFN]
        self.recent_events.append(recent)
        for session in list(self.sessions.values()):
            if session.worker is skip:
                continue
            event = Event(kind=kind, reason=reason, view=self.view_for(session.worker), at_s=at_s)
            if info is not None:
                event.worker.CopyFrom(info)
            if not session.mailbox.offer(afd_pb2.SessionMessage(event=event)):
                self._cut_off(session, "fell behind: membership event could not be queued")
        if self.taps:
            self.taps.offer(afd_pb2.TapEvent(membership=recent), payloads=False)

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
    def worker_info(self, worker: Worker) -> afd_pb2.WorkerInfo:
        return worker_info(worker)

    def view_for(self, worker: Worker) -> afd_pb2.View:
        return view_for(self.membership, self.incarnation, worker)

    def status(self) -> afd_pb2.Status:
        return status_of(self)

    def list_workers(self, role: str | None) -> list[afd_pb2.WorkerInfo]:
        return [worker_info(w) for w in self.membership.workers if role in (None, w.role)]
