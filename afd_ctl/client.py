"""The worker side of afd-ctl: register, publish, receive payloads, learn of membership changes.

Plain threads, no asyncio (vLLM workers are not asyncio). One background thread reads the
worker's Session stream; it keeps reconnecting with backoff when the daemon goes away and
re-registers under the same identity. Attention senders publish on one long-lived stream fed
by a queue, so `publish` never blocks the step. FFN workers take payloads with
`next_payload(timeout_s)`. Membership changes surface as typed exceptions, in stream order:

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

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from afd_ctl.channel import DEFAULT_CONTROLLER, ClientTls, auth_metadata, open_channel
from afd_ctl.errors import (
    AfdControllerUnreachable,
    AfdError,
    AfdNotReady,
    AfdPeerLost,
    AfdRejected,
    AfdStaleEpoch,
    AfdStopped,
    AfdTimeout,
)
from afd_ctl.membership import WorkerSpec
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.wire import PUBLISH_SECRET_METADATA, ROLE_TO_PROTO, WORKER_ID_METADATA

log = logging.getLogger(__name__)

__all__ = ["ControllerClient", "WorkerSpec", "ClientTls", "DEFAULT_CONTROLLER"]

# Registration refusals that retrying cannot fix.
PERMANENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
}
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
# close(reason=...) waits this long for the daemon to take the `leave` before hanging up.
LEAVE_WAIT_S = 1.0
Kind = afd_pb2.MembershipEvent.Kind
EventListener = Callable[[afd_pb2.MembershipEvent], None]


Reason = afd_pb2.PublishRejected.Reason
# Refusals that mean "your view is out of date": refresh it (wait_complete) and resend.
STALE_REASONS = (Reason.STALE_EPOCH, Reason.SESSION_ENDED)


def _rejection(rejected: afd_pb2.PublishRejected) -> AfdRejected:
    code = rejected.code
    name = next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
    if rejected.reason in STALE_REASONS:
        return AfdStaleEpoch(name, rejected.message)
    return AfdRejected(name, rejected.message)


class ControllerClient:
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
        self._beat_s = liveness_timeout_s / 4
        self._metadata = auth_metadata(token)
        self._channel = open_channel(target, tls, liveness_timeout_s)
        self._stub = afd_pb2_grpc.AFDControllerStub(self._channel)
        self._cond = threading.Condition()
        self._payloads: queue.SimpleQueue[afd_pb2.AFDControlPayload | AfdError] = (
            queue.SimpleQueue()
        )
        self._listeners: list[EventListener] = []
        self._unreachable_listeners: list[Callable[[AfdControllerUnreachable], None]] = []
        # Guarded by _cond:
        self._registered: afd_pb2.Registered | None = None
        self._view: afd_pb2.View | None = None
        self._unreachable: AfdControllerUnreachable | None = None
        self._fatal: AfdError | None = None
        self._stopped: AfdStopped | None = None
        self._drained = False
        self._lost: AfdPeerLost | None = None
        self._was_complete = False
        # Epoch of the last complete view handed to the caller by wait_complete().
        self._acknowledged_epoch = 0
        self._closing = False
        self._session_call: grpc.Call | None = None
        self._session_hung_up: threading.Event | None = None
        self._leave_reason = ""
        self._rejoining = ""
        self._session_thread: threading.Thread | None = None
        # Publishing (attention senders):
        self._rejections: deque[AfdRejected] = deque()
        self._publish_queue: queue.SimpleQueue[afd_pb2.AFDControlPayload | None] | None = None
        self._publish_call: grpc.Call | None = None
        self._publish_lock = threading.Lock()

    # -- registration --------------------------------------------------------------------
    def connect(self, timeout_s: float = 30.0) -> afd_pb2.Registered:
        """Registers (retrying while the daemon is unreachable or the slot is still held)."""
        if self._session_thread is None:
            self._session_thread = threading.Thread(
                target=self._session_loop, name=f"afd-session-{self.spec.worker_id}", daemon=True
            )
            self._session_thread.start()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._registered is None:
                if self._fatal is not None:
                    raise self._fatal
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = f": {self._unreachable}" if self._unreachable else ""
                    raise AfdTimeout(
                        f"could not register with afd-ctl at {self.target} within "
                        f"{timeout_s:.1f} s{why}; is `afd-ctl serve` running there?"
                    )
                self._cond.wait(remaining)
            return self._registered

    def wait_complete(self, timeout_s: float = 60.0, *, after_epoch: int = 0) -> afd_pb2.View:
        """Blocks until every expected worker is registered (in an epoch newer than
        `after_epoch`: after a loss the data plane saw first, the daemon's view must move on
        before it is worth reconnecting); returns that view."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                if self._stopped is not None:
                    raise self._stopped
                view = self._view
                if (
                    view is not None
                    and view.complete
                    and view.epoch > after_epoch
                    and self._unreachable is None
                ):
                    # The caller has seen this epoch: older payloads and losses are history.
                    self._acknowledged_epoch = max(self._acknowledged_epoch, view.epoch)
                    return view
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AfdTimeout(self._incomplete_message(f"after {timeout_s:.1f} s"))
                self._cond.wait(remaining)

    def wait_drained(self, timeout_s: float) -> bool:
        """Blocks until the daemon itself sends STOP (drain or `afd-ctl stop`); False on
        timeout. A stop payload from the attention side does not end this wait."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._drained and self._fatal is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._drained

    def wait_stopped(self, timeout_s: float) -> bool:
        """Blocks until the job is stopped (stop payload or STOP event); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._stopped is None and self._fatal is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._stopped is not None

    def _incomplete_message(self, when: str) -> str:
        if self._unreachable is not None:
            return f"{self._unreachable} ({when})"
        view = self._view
        if view is None:
            return f"not registered with afd-ctl at {self.target} {when}"
        return (
            f"the expected set ({view.expected_attention} attention, {view.expected_ffn} ffn) "
            f"is incomplete {when}; `afd-ctl status --controller {self.target}` shows who is "
            "missing"
        )

    @property
    def view(self) -> afd_pb2.View:
        with self._cond:
            if self._view is None:
                raise AfdNotReady("not registered yet: call connect() first")
            return self._view

    @property
    def registered(self) -> afd_pb2.Registered:
        with self._cond:
            if self._registered is None:
                raise AfdNotReady("not registered yet: call connect() first")
            return self._registered

    @property
    def role_rank(self) -> int:
        return self.registered.worker.role_rank

    @property
    def is_sender(self) -> bool:
        return self.registered.is_sender

    def add_listener(self, listener: EventListener) -> None:
        """`listener(event)` runs on the session thread for every membership event."""
        self._listeners.append(listener)

    def add_unreachable_listener(
        self, listener: Callable[[AfdControllerUnreachable], None]
    ) -> None:
        """`listener(error)` runs on the session thread each time the registered session
        breaks (the daemon died or restarted, the network dropped). Whatever afd-ctl comes
        back with is a new epoch, so a data plane can give up the current one at once."""
        self._unreachable_listeners.append(listener)

    # -- the session thread --------------------------------------------------------------
    def _session_loop(self) -> None:
        spec = self.spec
        register = afd_pb2.RegisterRequest(
            role=ROLE_TO_PROTO.get(spec.role, afd_pb2.ROLE_UNSPECIFIED),
            dp_rank=spec.dp_rank,
            dp_size=spec.dp_size,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            worker_id=spec.worker_id,
            data_plane_blob=self.data_plane_blob,
        )
        backoff = BACKOFF_MIN_S
        while True:
            hung_up = threading.Event()
            with self._cond:
                if self._closing or self._stopped is not None:
                    return
                requests = _session_requests(
                    register, hung_up, self._beat_s, lambda: self._leave_reason or self._rejoining
                )
                call = self._stub.Session(requests, metadata=self._metadata)
                self._session_call, self._session_hung_up = call, hung_up
            watchdog = _Watchdog(call, self.liveness_timeout_s)
            registered_here = False
            error: grpc.RpcError | None = None
            try:
                for message in call:
                    watchdog.heard()
                    registered_here = True
                    backoff = BACKOFF_MIN_S
                    self._handle(message)
            except grpc.RpcError as exc:
                error = exc
            finally:
                hung_up.set()
                watchdog.stop()
            with self._cond:
                if self._closing or self._stopped is not None:
                    return
                if self._rejoining:
                    log.info("re-registering with afd-ctl (%s)", self._rejoining)
                    self._rejoining = ""
                    backoff = BACKOFF_MIN_S
                    continue
                code = error.code() if error is not None else grpc.StatusCode.OK
                details = error.details() if error is not None else "stream ended"
                if watchdog.fired:
                    details = f"nothing heard for {self.liveness_timeout_s} s"
                if not registered_here and code in PERMANENT_CODES:
                    self._fatal = AfdRejected(code.name, details or "")
                    log.error("afd-ctl refused registration: %s: %s", code.name, details)
                    self._cond.notify_all()
                    return
                if registered_here or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK):
                    what = "unreachable"
                else:
                    what = "did not accept the registration"
                self._unreachable = AfdControllerUnreachable(
                    f"afd-ctl at {self.target} {what} ({code.name}: {details}); "
                    "retrying in the background"
                )
                if registered_here:
                    log.warning("%s", self._unreachable)
                    self._payloads.put(self._unreachable)
                    for listener in self._unreachable_listeners:
                        try:
                            listener(self._unreachable)
                        except Exception:  # a listener's bug must not kill the session thread
                            log.exception("unreachable listener failed")
                self._cond.notify_all()
                delay = backoff * (1 + random.random() / 2)
                # At most a quarter of the liveness bound apart: a restarted daemon sees its
                # workers again well within the bound it declares them lost in.
                backoff = min(backoff * 2, BACKOFF_MAX_S, self.liveness_timeout_s / 4)
                self._cond.wait(delay)

    def _handle(self, message: afd_pb2.SessionMessage) -> None:
        which = message.WhichOneof("message")
        if which == "payload":
            payload = message.payload
            if payload.stop:
                # The worker stays registered until it closes: others may still be finishing.
                self._stop(f"the attention side sent stop at step {payload.step_id}", hang_up=False)
            else:
                self._payloads.put(payload)
            return
        if which == "heartbeat":
            return
        if which == "registered":
            # The publish lock first (the order _publish_stream takes them in): no stream can
            # open with the old secret once the new one is here.
            with self._publish_lock, self._cond:
                again = self._registered is not None
                if self._publish_queue is not None:
                    # A new session: the open publish stream is bound to the old one.
                    self._retire_publish_stream()
                self._registered = message.registered
                self._view = message.registered.view
                self._unreachable = None
                self._note_view()
                self._cond.notify_all()
            log.info(
                "%s afd-ctl as %s rank %d, epoch %d",
                "re-registered with" if again else "registered with",
                self.spec.role.lower(),
                message.registered.worker.role_rank,
                message.registered.view.epoch,
            )
            return
        event = message.event
        with self._cond:
            self._view = event.view
            if event.kind == Kind.PEER_LOST:
                lost = event.worker
                self._lost = AfdPeerLost(
                    f"afd peer lost: {afd_pb2.Role.Name(lost.role).lower()} rank "
                    f"{lost.role_rank} ({lost.worker_id}): {event.reason}; now epoch "
                    f"{event.view.epoch}, waiting for a replacement",
                    epoch=event.view.epoch,
                )
                self._payloads.put(self._lost)
            self._note_view()
            self._cond.notify_all()
        if event.kind == Kind.STOP:
            with self._cond:
                self._drained = True
            self._stop(f"afd-ctl sent stop: {event.reason}")
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not kill the session thread
                log.exception("membership listener failed")

    def _note_view(self) -> None:
        if self._view is not None and self._view.complete:
            self._was_complete = True
            self._lost = None

    def _stop(self, reason: str, hang_up: bool = True) -> None:
        """Stopped for good: tell the caller; on the daemon's STOP also hang up at once, so a
        draining daemon can exit without waiting for the caller to close."""
        with self._cond:
            if self._stopped is None:
                self._stopped = AfdStopped(reason)
                self._payloads.put(self._stopped)
                log.info("stopped: %s", reason)
            call = self._session_call if hang_up else None
            self._cond.notify_all()
        if call is not None:
            call.cancel()  # type: ignore[attr-defined]

    # -- FFN side ------------------------------------------------------------------------
    def next_payload(self, timeout_s: float) -> afd_pb2.AFDControlPayload:
        """The next payload for this worker, in order, or a typed exception:

        AfdStopped (exit cleanly), AfdPeerLost (call wait_complete, reconnect the data plane),
        AfdControllerUnreachable (the client is reconnecting), AfdTimeout (nothing came)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self._payloads.get_nowait()
            except queue.Empty:
                self._raise_condition()
                try:
                    item = self._payloads.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self._raise_condition()
                    raise AfdTimeout(
                        f"no payload from afd-ctl within {timeout_s:.3f} s "
                        f"(epoch {self._view.epoch if self._view else '-'})"
                    ) from None
            if self._is_history(item):
                continue
            if isinstance(item, AfdError):
                raise item
            return item

    def _is_history(self, item: afd_pb2.AFDControlPayload | AfdError) -> bool:
        """Payloads and losses from before the epoch the caller last waited for are dropped:
        the caller already reconnected past them."""
        acknowledged = self._acknowledged_epoch
        if isinstance(item, AfdPeerLost):
            return item.epoch is not None and item.epoch <= acknowledged
        if isinstance(item, AfdError):
            return False
        return item.epoch < acknowledged

    def _raise_condition(self) -> None:
        """Raises what keeps this worker from making progress now, if anything."""
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            if self._stopped is not None:
                raise self._stopped
            if self._closing:
                raise AfdError("the client is closed")
            if self._unreachable is not None:
                raise self._unreachable
            if self._view is None:
                raise AfdNotReady("not registered yet: call connect() first")
            if not self._view.complete:
                if self._lost is not None and self._was_complete:
                    raise self._lost
                raise AfdNotReady(self._incomplete_message("now") + "; call wait_complete()")

    # -- attention side ------------------------------------------------------------------
    def publish(self, payload: afd_pb2.AFDControlPayload, *, stamp: bool = True) -> None:
        """Queues `payload` on the publish stream and returns at once (ordered delivery).

        With stamp=True the current epoch and this worker's role rank are filled in. A payload
        the daemon refused surfaces as AfdRejected (AfdStaleEpoch for an old epoch) on the next
        call, naming the field."""
        if self._rejections:
            raise self._rejections.popleft()
        if not payload.stop:
            self._raise_condition()
        if stamp:
            with self._cond:
                view, registered = self._view, self._registered
            if view is None or registered is None:
                raise AfdNotReady("not registered yet: call connect() first")
            payload.epoch = view.epoch
            payload.sender_role_rank = registered.worker.role_rank
        self._publish_stream().put(payload)

    def _publish_stream(self) -> queue.SimpleQueue[afd_pb2.AFDControlPayload | None]:
        with self._publish_lock:
            if self._publish_queue is not None:
                return self._publish_queue
            requests: queue.SimpleQueue[afd_pb2.AFDControlPayload | None] = queue.SimpleQueue()
            with self._cond:
                secret = self._registered.publish_secret if self._registered else ""
            metadata = (
                *self._metadata,
                (WORKER_ID_METADATA, self.spec.worker_id),
                (PUBLISH_SECRET_METADATA, secret),
            )
            call = self._stub.Publish(_drain(requests), metadata=metadata)
            self._publish_queue, self._publish_call = requests, call
            threading.Thread(
                target=self._read_acks, args=(call, requests), name="afd-publish-acks", daemon=True
            ).start()
            return requests

    def _retire_publish_stream(self) -> None:
        """Half-closes the publish stream (call with _publish_lock held); the next publish
        opens one for the new session."""
        if self._publish_queue is not None:
            self._publish_queue.put(None)
        self._publish_queue = self._publish_call = None

    def _is_current(self, requests: queue.SimpleQueue) -> bool:
        with self._publish_lock:
            return self._publish_queue is requests

    def _read_acks(self, call: Iterator[afd_pb2.PublishAck], requests: queue.SimpleQueue) -> None:
        try:
            for ack in call:
                if self._is_current(requests):  # a retired stream's are about an old session
                    self._rejections.append(_rejection(ack.rejected))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning("publish stream ended: %s: %s", exc.code().name, exc.details())
                if exc.code() in PERMANENT_CODES and self._is_current(requests):
                    self._rejections.append(AfdRejected(exc.code().name, exc.details() or ""))

        with self._publish_lock:
            if self._publish_queue is requests:
                self._publish_queue = None
                self._publish_call = None
        requests.put(None)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Half-closes the publish stream and waits until the daemon has read everything;
        raises the first rejection, if any. The next publish opens a new stream."""
        with self._publish_lock:
            requests, call = self._publish_queue, self._publish_call
        if requests is None or call is None:
            if self._rejections:
                raise self._rejections.popleft()
            return
        requests.put(None)
        deadline = time.monotonic() + timeout_s
        while not call.done():  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise AfdTimeout(f"publish stream not drained within {timeout_s:.1f} s")
            time.sleep(0.002)
        time.sleep(0.01)  # let the ack reader append what it read
        if self._rejections:
            raise self._rejections.popleft()

    # -- shutdown ------------------------------------------------------------------------
    @property
    def rejoin_after_s(self) -> float:
        """How long a worker should see a data-plane loss that afd-ctl does not report before
        it rejoins: well past the liveness bound, so a real death is reported first."""
        return max(5.0, 2 * self.liveness_timeout_s + 1)

    def discard_rejections(self) -> None:
        """Drops refusals not yet raised (after a reconnect they are about older payloads)."""
        self._rejections.clear()

    def rejoin(self, reason: str, timeout_s: float = LEAVE_WAIT_S) -> None:
        """Leaves (saying why) and registers again under the same identity, so afd-ctl moves
        every peer to a new epoch. For a worker whose data plane is stuck while afd-ctl still
        sees everyone alive (a wait that timed out with no membership change): the new epoch
        makes every peer drop the step and reconnect. Returns once the old session ended."""
        with self._cond:
            call, hung_up = self._session_call, self._session_hung_up
            if call is None or hung_up is None or self._closing or self._unreachable:
                return  # no session to leave (the client re-registers by itself anyway)
            if call.done():  # type: ignore[attr-defined]
                return
            self._rejoining = f"rejoining: {reason}"
        log.warning("leaving afd-ctl to rejoin in a new epoch: %s", reason)
        hung_up.set()  # sends `leave` and half-closes; the daemon then ends the call
        deadline = time.monotonic() + timeout_s
        while not call.done() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        call.cancel()  # type: ignore[attr-defined]

    def close(self, timeout_s: float = 2.0, *, reason: str = "") -> None:
        """Ends the session (the daemon sees this worker leave) and the publish stream.

        With a `reason` ("RuntimeError: ...", "stop received") the daemon is told why first,
        and every peer's PEER_LOST event says "left: <reason>"."""
        with self._cond:
            self._closing = True
            self._leave_reason = reason
            call, hung_up = self._session_call, self._session_hung_up
            self._cond.notify_all()
        with self._publish_lock:
            if self._publish_queue is not None:
                self._publish_queue.put(None)
        if call is not None and reason and hung_up is not None and not call.done():  # type: ignore[attr-defined]
            hung_up.set()  # sends `leave` and half-closes; the daemon then ends the call
            deadline = time.monotonic() + min(timeout_s, LEAVE_WAIT_S)
            while not call.done() and time.monotonic() < deadline:  # type: ignore[attr-defined]
                time.sleep(0.01)
        if call is not None:
            call.cancel()  # type: ignore[attr-defined]
        if self._session_thread is not None:
            self._session_thread.join(timeout_s)
        self._channel.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _session_requests(
    register: afd_pb2.RegisterRequest,
    hung_up: threading.Event,
    beat_s: float,
    leaving: Callable[[], str],
) -> Iterator[afd_pb2.SessionRequest]:
    """register, heartbeats until hung up, and `leave` (then half-close) once the worker
    closes with a reason."""
    yield afd_pb2.SessionRequest(register=register)
    heartbeat = afd_pb2.SessionRequest(heartbeat=afd_pb2.Heartbeat())
    while True:
        hung = hung_up.wait(beat_s)
        reason = leaving()
        if reason:
            yield afd_pb2.SessionRequest(leave=afd_pb2.Leave(reason=reason))
            return
        if hung:
            return
        yield heartbeat


class _Watchdog:
    """Cancels a session call when the daemon has said nothing for the liveness timeout."""

    def __init__(self, call: grpc.Call, liveness_timeout_s: float) -> None:
        self._call = call
        self._timeout_s = liveness_timeout_s
        self._last = time.monotonic()
        self._done = threading.Event()
        self.fired = False
        threading.Thread(target=self._run, name="afd-session-watchdog", daemon=True).start()

    def heard(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self._timeout_s / 4):
            if time.monotonic() - self._last > self._timeout_s:
                self.fired = True
                self._call.cancel()  # type: ignore[attr-defined]
                return


def _drain(requests: queue.SimpleQueue[afd_pb2.AFDControlPayload | None]) -> Iterator:
    while True:
        item = requests.get()
        if item is None:
            return
        yield item
