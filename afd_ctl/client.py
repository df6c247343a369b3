"""The worker side of afd-ctl: register, publish, receive payloads, learn of membership changes.

Plain threads, no asyncio (vLLM workers are not asyncio). `ControllerClient` is the facade
over three parts: the session link (`session_link.py`: the stream, reconnect with backoff,
heartbeats), the membership view (`membership_view.py`: the state and every `wait_*`) and the
publisher (`publisher.py`: attention senders' one long-lived PublishBatch stream, so `publish`
never blocks the step). FFN workers take payloads with `next_payload(timeout_s)`. Membership
changes surface as typed exceptions, in stream order:

    client = ControllerClient("10.0.0.1:50051", WorkerSpec("ffn-0", "FFN"), data_plane_blob=blob)
    client.connect(timeout_s=30)
    view = client.wait_complete(timeout_s=120)
    while True:
        try:
            payload = client.next_payload(timeout_s=5)
        except AfdPeerLost:
            view = client.wait_complete(timeout_s=120)   # reconnect the data plane to view.peers
        except AfdStopped:
            break
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from afd_ctl.channel import DEFAULT_CONTROLLER, ClientTls, auth_metadata, open_channel
from afd_ctl.errors import AfdControllerUnreachable
from afd_ctl.membership import WorkerSpec
from afd_ctl.membership_view import MembershipView
from afd_ctl.publisher import Publisher
from afd_ctl.routing import Role
from afd_ctl.session_link import LEAVE_WAIT_S, SessionLink
from afd_ctl.step_reporter import StepReporter
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.wire import ROLE_TO_PROTO

log = logging.getLogger(__name__)

__all__ = ["ControllerClient", "WorkerSpec", "ClientTls", "DEFAULT_CONTROLLER"]

EventListener = Callable[[afd_pb2.MembershipEvent], None]
Kind = afd_pb2.MembershipEvent.Kind


class ControllerClient:
    """One worker's client: connect, wait for the expected set, then publish or receive."""

    def __init__(
        self,
        target: str,
        spec: WorkerSpec,
        *,
        data_plane_blob: bytes = b"",
        token: str = "",
        tls: ClientTls | None = None,
        liveness_timeout_s: float = 2.0,
    ) -> None:
        self.target = target
        self.spec = spec
        self.data_plane_blob = data_plane_blob or spec.data_plane_blob
        self.liveness_timeout_s = liveness_timeout_s
        metadata = auth_metadata(token)
        self._channel = open_channel(target, tls, liveness_timeout_s)
        stub = afd_pb2_grpc.AFDControllerStub(self._channel)
        self._listeners: list[EventListener] = []
        self._retired = False
        self._view = MembershipView(target)
        # Its coalescing window (`window`) and what it sent (`sent`) are the data plane's.
        self.publisher = Publisher(stub, metadata, spec.worker_id, self._publish_secret)
        register = afd_pb2.RegisterRequest(
            role=ROLE_TO_PROTO.get(spec.role, afd_pb2.ROLE_UNSPECIFIED),
            dp_rank=spec.dp_rank,
            dp_size=spec.dp_size,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            worker_id=spec.worker_id,
            data_plane_blob=self.data_plane_blob,
            max_attention=spec.max_attention,
            max_ffn=spec.max_ffn,
            follows_scale=spec.follows_scale,
            lockstep_size=spec.lockstep_size,
            step_socket=spec.step_socket,
        )
        if spec.model is not None:
            register.model.CopyFrom(afd_pb2.ModelFingerprint(**dataclasses.asdict(spec.model)))
        self._link = SessionLink(
            stub, metadata, register, self._view, self._handle, liveness_timeout_s, tls
        )
        # Per-step timings to the daemon (issue 26): optional, used by workers that call
        # `timings.step(...)`; the daemon asks only those for trace spans.
        self.timings = StepReporter(self._link.send)

    # -- registration --------------------------------------------------------------------
    def connect(self, timeout_s: float = 30.0) -> afd_pb2.Registered:
        """Registers (retrying while the daemon is unreachable or the slot is still held)."""
        self._link.start()
        return self._view.wait_registered(timeout_s)

    def wait_complete(self, timeout_s: float = 60.0, *, after_epoch: int = 0) -> afd_pb2.View:
        """Blocks until every expected worker is registered (in an epoch newer than
        `after_epoch`: after a loss the data plane saw first, the daemon's view must move on
        before it is worth reconnecting); returns that view."""
        return self._view.wait_complete(timeout_s, after_epoch)

    def wait_drained(self, timeout_s: float) -> bool:
        """Blocks until the daemon this worker is registered with goes away: STOP (`afd-ctl
        stop`) or DAEMON_DRAINING (SIGTERM); False on timeout. A stop payload from the
        attention side does not end this wait."""
        return self._view.wait_drained(timeout_s)

    def wait_stopped(self, timeout_s: float) -> bool:
        """Blocks until the job is stopped (stop payload or STOP event); False on timeout."""
        return self._view.wait_stopped(timeout_s)

    def serving(self) -> bool:
        """Registered, afd-ctl reachable and the expected set complete (a readiness check;
        never blocks on the network)."""
        return self._view.serving()

    def incomplete_message(self, when: str) -> str:
        """What keeps the set from being complete (or afd-ctl from answering), `when` said
        in it: "the expected set (1 attention, 1 ffn) is incomplete <when>; ..."."""
        return self._view.incomplete_message(when)

    @property
    def view(self) -> afd_pb2.View:
        return self._view.view()

    @property
    def registered(self) -> afd_pb2.Registered:
        return self._view.registered()

    @property
    def role_rank(self) -> int:
        return self.registered.worker.role_rank

    @property
    def is_sender(self) -> bool:
        """This worker publishes payloads in the current epoch (a planned change can make an
        attention worker a sender or stop it being one)."""
        view, registered = self._view.view(), self.registered
        if view.epoch == registered.view.epoch:
            return registered.is_sender
        return registered.worker.role_rank in view.sender_ranks

    # -- planned changes (issue 37) --------------------------------------------------------
    @property
    def leaving(self) -> bool:
        """afd-ctl's target has no place for this worker: take no new work, finish what is in
        flight, then call `drained` (an attention worker); RETIRED follows."""
        return self._view.view().leaving

    @property
    def retired(self) -> bool:
        """A planned change left this worker out and afd-ctl retired it (RETIRED)."""
        return self._retired

    @property
    def holding(self) -> bool:
        """afd-ctl asks attention workers to hold between steps (a change at its fence)."""
        return self._view.view().hold

    def drained(self, reason: str = "") -> None:
        """Tells afd-ctl this leaving worker has nothing in flight and takes no new work."""
        self._link.send(afd_pb2.SessionRequest(drained=afd_pb2.Drained(reason=reason)))

    def hold(self, last_step_id: int = 0, timeout_s: float = 60.0) -> afd_pb2.View | None:
        """Call between steps. When afd-ctl asks attention workers to hold (a planned change
        at its fence), says so (`fenced`, with the last step this worker published, 0 for
        none) and waits until the hold is lifted: returns that view (SCALED: the new epoch,
        whose peers to reconnect to). None when no hold was asked. AfdTimeout after
        `timeout_s`."""
        if not self.fenced(last_step_id):
            return None
        return self._view.wait_unheld(timeout_s)

    def fenced(self, last_step_id: int = 0) -> bool:
        """Says `fenced` (with the last step this worker published) when afd-ctl asks for a
        hold, without waiting; False when it does not. For a worker with no step in flight
        (idle), from any thread; its next step then calls `hold`, which waits."""
        view = self._view.view()
        if not view.hold:
            return False
        fenced = afd_pb2.Fenced(epoch=view.epoch, last_step_id=last_step_id)
        self._link.send(afd_pb2.SessionRequest(fenced=fenced))
        return True

    def add_listener(self, listener: EventListener) -> None:
        """`listener(event)` runs on the session thread for every membership event."""
        self._listeners.append(listener)

    def add_unreachable_listener(
        self, listener: Callable[[AfdControllerUnreachable], None]
    ) -> None:
        """`listener(error)` runs on the session thread each time the registered session
        breaks (the daemon died or restarted, the network dropped). Whatever afd-ctl comes
        back with is a new epoch, so a data plane can give up the current one at once."""
        self._link.add_unreachable_listener(listener)

    # -- messages from the session thread ------------------------------------------------
    def _handle(self, message: afd_pb2.SessionMessage) -> None:
        which = message.WhichOneof("message")
        if which == "payload":
            payload = message.payload
            if payload.stop:
                # The worker stays registered until it closes: others may still be finishing.
                self._view.stop(f"the attention side sent stop at step {payload.step_id}")
            else:
                self._view.on_payload(payload)
            return
        if which == "heartbeat":
            return
        if which == "trace_start":
            self.timings.on_trace_start(message.trace_start)
            return
        if which == "registered":
            # The publish lock first (the order publishing takes them in): no stream can open
            # with the old secret once the new one is here.
            with self.publisher.lock, self._view.cond:
                # A new session: the open publish stream is bound to the old one.
                self.publisher.retire()
                again = self._view.on_registered(message.registered)
            log.info(
                "%s afd-ctl as %s rank %d, epoch %d",
                "re-registered with" if again else "registered with",
                self.spec.role.lower(),
                message.registered.worker.role_rank,
                message.registered.view.epoch,
            )
            return
        event = message.event
        self._view.on_event(event)
        # Hang up at once either way, so a draining daemon can exit without waiting for us.
        if event.kind == Kind.STOP and self.spec.role == Role.FFN:
            # afd-ctl stop: the deployment shuts down, and an FFN worker with it.
            self._view.stop(f"afd-ctl sent stop: {event.reason}")
            self._link.hang_up()
        elif event.kind == Kind.RETIRED:
            # A planned change left this worker out (issue 37): done, never registered again.
            self._retired = True
            self._view.stop(f"retired by afd-ctl: {event.reason}")
            self._link.hang_up()
        elif event.kind in (Kind.STOP, Kind.DAEMON_DRAINING):
            # A daemon restart, or a stop for an attention worker, which (unlike an FFN worker)
            # has no one to restart it into a new deployment: out of service until a daemon
            # answers again, never stopped for good (the proto's MembershipEvent.Kind).
            what = "sent stop" if event.kind == Kind.STOP else "is draining"
            self._link.hang_up(
                f"afd-ctl {what} ({event.reason}); registering again once a daemon answers"
            )
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not kill the session thread
                log.exception("membership listener failed")

    def _publish_secret(self) -> str:
        with self._view.cond:
            registered = self._view.registered_msg
            return registered.publish_secret if registered else ""

    # -- FFN side ------------------------------------------------------------------------
    def next_payload(self, timeout_s: float) -> afd_pb2.AFDControlPayload:
        """The next payload for this worker, in order, or a typed exception:

        AfdStopped (exit cleanly), AfdPeerLost (call wait_complete, reconnect the data plane),
        AfdControllerUnreachable (the client is reconnecting), AfdTimeout (nothing came)."""
        return self._view.next_payload(timeout_s)

    def poll_payload(self) -> afd_pb2.AFDControlPayload | None:
        """The next payload if one is already here (or the typed error in its place), else None;
        never waits. `on_inbound(callback)` says when to look again."""
        return self._view.poll_payload()

    def on_inbound(self, callback: Callable[[], None] | None) -> None:
        """`callback` runs (on the session's thread) each time something is queued for
        next_payload / poll_payload: a payload, a loss, a stop."""
        self._view.on_inbound = callback

    # -- attention side ------------------------------------------------------------------
    def publish(self, payload: afd_pb2.AFDControlPayload, *, stamp: bool = True) -> None:
        """Queues `payload` on the publish stream and returns at once (ordered delivery).

        With stamp=True the current epoch and this worker's role rank are filled in. A payload
        the daemon refused surfaces as AfdRejected (AfdStaleEpoch for an old epoch) on the next
        call, naming the field."""
        if stamp:
            self.stamp(payload)
        else:
            self._check_publishable(payload)
        self.publisher.put(payload)

    def stamp(self, payload: afd_pb2.AFDControlPayload) -> None:
        """Fills in the current epoch and this worker's role rank, as `publish` does, raising
        what `publish` would raise first (a refusal, a lost set): a sender that copies the
        payload elsewhere before publishing it stamps it with this."""
        self._check_publishable(payload)
        self._view.stamp(payload)

    def _check_publishable(self, payload: afd_pb2.AFDControlPayload) -> None:
        self.publisher.raise_rejection()
        if not payload.stop:
            self._view.raise_condition()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Half-closes the publish stream and waits until the daemon has read everything;
        raises the first rejection, if any. The next publish opens a new stream."""
        self.publisher.flush(timeout_s)

    def discard_rejections(self) -> None:
        """Drops refusals not yet raised (after a reconnect they are about older payloads)."""
        self.publisher.discard_rejections()

    # -- shutdown ------------------------------------------------------------------------
    @property
    def rejoin_after_s(self) -> float:
        """How long a worker should see a data-plane loss that afd-ctl does not report before
        it rejoins: well past the liveness bound, so a real death is reported first."""
        return max(5.0, 2 * self.liveness_timeout_s + 1)

    def rejoin(self, reason: str, timeout_s: float = LEAVE_WAIT_S) -> None:
        """Leaves (saying why) and registers again under the same identity, so afd-ctl moves
        every peer to a new epoch. For a worker whose data plane is stuck while afd-ctl still
        sees everyone alive (a wait that timed out with no membership change): the new epoch
        makes every peer drop the step and reconnect. Returns once the old session ended."""
        self._link.rejoin(reason, timeout_s)

    def close(self, timeout_s: float = 2.0, *, reason: str = "") -> None:
        """Ends the session (the daemon sees this worker leave) and the publish stream.

        With a `reason` ("RuntimeError: ...", "stop received") the daemon is told why first,
        and every peer's PEER_LOST event says "left: <reason>"."""
        self.timings.close()  # its last steps go before the session ends
        self._link.begin_close(reason)
        self.publisher.close()
        self._link.close(timeout_s)
        self._channel.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
