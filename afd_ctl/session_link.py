"""The worker's Session stream to afd-ctl: register, heartbeats, reconnect with backoff.

One background thread holds the stream. When the daemon goes away it reconnects with jittered
backoff and registers again under the same identity; a watchdog cancels a stream the daemon
stopped answering on. Messages go to `on_message`; the state they change lives in the
`MembershipView`, whose lock this link shares.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from afd_ctl.channel import CLOSED_IN_HANDSHAKE_STRIKES, ClientTls, tls_problem
from afd_ctl.errors import AfdControllerUnreachable, AfdRejected
from afd_ctl.membership_view import MembershipView
from afd_ctl.threads import named_thread
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

log = logging.getLogger(__name__)

# Registration refusals that retrying cannot fix (FAILED_PRECONDITION: a model mismatch).
PERMANENT_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
}
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
# close(reason=...) and rejoin() wait this long for the daemon to take the `leave`.
LEAVE_WAIT_S = 1.0
# A daemon whose connection answers keepalive pings but which has sent nothing (not even a
# heartbeat) this long is taken as wedged: the daemon's own --heartbeat-timeout-s default.
# A daemon that died, froze or lost the network fails grpc's keepalive within the liveness
# bound instead, in grpc's C core, whatever this worker's Python is doing (README "Liveness").
SILENT_DAEMON_S = 60.0
UnreachableListener = Callable[[AfdControllerUnreachable], None]
# Optional messages (timing reports, trace spans) waiting for the stream; more are dropped.
OUTBOX_SIZE = 8


class SessionLink:
    """The Session stream of one worker, kept up until `close()` or a stop."""

    def __init__(
        self,
        stub: afd_pb2_grpc.AFDControllerStub,
        metadata: tuple[tuple[str, str], ...],
        register: afd_pb2.RegisterRequest,
        view: MembershipView,
        on_message: Callable[[afd_pb2.SessionMessage], None],
        liveness_timeout_s: float,
        tls: ClientTls | None = None,
    ) -> None:
        self._stub = stub
        self._tls = tls
        # Until the first registration, a TLS handshake that fails is a setting to fix, not an
        # outage to ride out: it ends connect() at once, naming the file (issue 22).
        self._ever_registered = False
        self._metadata = metadata
        self._register = register
        self._view = view
        self._cond = view.cond
        self._on_message = on_message
        self.liveness_timeout_s = liveness_timeout_s
        self._beat_s = liveness_timeout_s / 4
        self._unreachable_listeners: list[UnreachableListener] = []
        self._outbox: queue.Queue[afd_pb2.SessionRequest | None] = queue.Queue(OUTBOX_SIZE)
        self._thread: threading.Thread | None = None
        # Guarded by the view's lock:
        self._call: grpc.Call | None = None
        self._hung_up: threading.Event | None = None
        self._ended: threading.Event | None = None
        self._leave_reason = ""
        self._rejoining = ""
        self._hang_up_reason = ""

    def start(self) -> None:
        if self._thread is None:
            self._thread = named_thread(self._run, f"afd-session-{self._register.worker_id}")
            self._thread.start()

    def add_unreachable_listener(self, listener: UnreachableListener) -> None:
        self._unreachable_listeners.append(listener)

    def send(self, request: afd_pb2.SessionRequest) -> bool:
        """Queues an optional message (StepTimings, TraceSpans) for the session stream; False
        when OUTBOX_SIZE are already waiting (it is dropped: the step never blocks on it)."""
        try:
            self._outbox.put_nowait(request)
        except queue.Full:
            return False
        return True

    def _wake(self, hung_up: threading.Event) -> None:
        hung_up.set()
        try:
            self._outbox.put_nowait(None)  # wakes the request generator
        except queue.Full:
            pass  # it has messages to send and looks at hung_up after each

    # -- the session thread --------------------------------------------------------------
    def _run(self) -> None:
        view = self._view
        backoff = BACKOFF_MIN_S
        handshake_strikes = 0
        while True:
            hung_up, ended = threading.Event(), threading.Event()
            with self._cond:
                if view.closing or view.stopped is not None:
                    return
                requests = _session_requests(
                    self._register,
                    hung_up,
                    self._beat_s,
                    lambda: self._leave_reason or self._rejoining,
                    self._outbox,
                )
                call = self._stub.Session(requests, metadata=self._metadata)
                call.add_done_callback(lambda _call, done=ended: done.set())
                self._call, self._hung_up, self._ended = call, hung_up, ended
            watchdog = _Watchdog(call, SILENT_DAEMON_S)
            registered_here = False
            error: grpc.RpcError | None = None
            try:
                for message in call:
                    watchdog.heard()
                    registered_here = True
                    backoff = BACKOFF_MIN_S
                    self._on_message(message)
            except grpc.RpcError as exc:
                error = exc
            finally:
                self._wake(hung_up)
                watchdog.stop()
            with self._cond:
                if view.closing or view.stopped is not None:
                    return
                if self._rejoining:
                    log.info("re-registering with afd-ctl (%s)", self._rejoining)
                    self._rejoining = ""
                    backoff = BACKOFF_MIN_S
                    continue
                code = error.code() if error is not None else grpc.StatusCode.OK
                details = error.details() if error is not None else "stream ended"
                if watchdog.fired:
                    details = f"nothing heard for {SILENT_DAEMON_S} s"
                if self._hang_up_reason and registered_here:
                    code, details = grpc.StatusCode.UNAVAILABLE, self._hang_up_reason
                self._hang_up_reason = ""
                if not registered_here and code in PERMANENT_CODES:
                    log.error("afd-ctl refused registration: %s: %s", code.name, details)
                    view.on_fatal(AfdRejected(code.name, details or ""))
                    return
                self._ever_registered = self._ever_registered or registered_here
                problem = None
                if not self._ever_registered and code == grpc.StatusCode.UNAVAILABLE:
                    problem = tls_problem(details or "", view.target, self._tls)
                handshake_strikes = handshake_strikes + 1 if problem else 0
                if problem and (problem[1] or handshake_strikes >= CLOSED_IN_HANDSHAKE_STRIKES):
                    log.error("%s", problem[0])
                    view.on_fatal(AfdRejected(code.name, problem[0]))
                    return
                if registered_here or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK):
                    what = "unreachable"
                else:
                    what = "did not accept the registration"
                unreachable = AfdControllerUnreachable(
                    f"afd-ctl at {view.target} {what} ({code.name}: {details}); "
                    "retrying in the background"
                )
                view.on_unreachable(unreachable, was_registered=registered_here)
                if registered_here:
                    log.warning("%s", unreachable)
                    for listener in self._unreachable_listeners:
                        try:
                            listener(unreachable)
                        except Exception:  # a listener's bug must not kill the session thread
                            log.exception("unreachable listener failed")
                delay = backoff * (1 + random.random() / 2)
                # At most a quarter of the liveness bound apart: a restarted daemon sees its
                # workers again well within the bound it declares them lost in.
                backoff = min(backoff * 2, BACKOFF_MAX_S, self.liveness_timeout_s / 4)
                self._cond.wait(delay)  # close() wakes it

    # -- ending the session --------------------------------------------------------------
    def hang_up(self, reason: str = "") -> None:
        """Cancels the current stream at once (after the daemon's STOP or DAEMON_DRAINING);
        unless the view is stopped, the link then registers again, saying `reason` as why the
        session broke."""
        with self._cond:
            call = self._call
            self._hang_up_reason = reason
        if call is not None:
            call.cancel()

    def rejoin(self, reason: str, timeout_s: float = LEAVE_WAIT_S) -> None:
        """Leaves saying why; the session thread then registers again at once."""
        with self._cond:
            call, hung_up, ended = self._call, self._hung_up, self._ended
            if call is None or hung_up is None or ended is None:
                return  # no session to leave (the link re-registers by itself anyway)
            if self._view.closing or self._view.unreachable or ended.is_set():
                return
            self._rejoining = f"rejoining: {reason}"
        log.warning("leaving afd-ctl to rejoin in a new epoch: %s", reason)
        self._wake(hung_up)  # sends `leave` and half-closes; the daemon then ends the call
        ended.wait(timeout_s)
        call.cancel()

    def begin_close(self, reason: str) -> None:
        """Marks the link closing: no reconnect from now on, and `reason` goes in the leave."""
        with self._cond:
            self._view.closing = True
            self._leave_reason = reason
            self._cond.notify_all()

    def close(self, timeout_s: float) -> None:
        """Ends the session (after `begin_close`); with a reason the daemon is told why
        first, waiting at most LEAVE_WAIT_S for it to take the leave."""
        with self._cond:
            reason = self._leave_reason
            call, hung_up, ended = self._call, self._hung_up, self._ended
        if call is not None and reason and hung_up is not None and ended is not None:
            if not ended.is_set():
                self._wake(hung_up)  # sends `leave` and half-closes; the daemon ends the call
                ended.wait(min(timeout_s, LEAVE_WAIT_S))
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout_s)


def _session_requests(
    register: afd_pb2.RegisterRequest,
    hung_up: threading.Event,
    beat_s: float,
    leaving: Callable[[], str],
    outbox: queue.Queue[afd_pb2.SessionRequest | None] | None = None,
) -> Iterator[afd_pb2.SessionRequest]:
    """register, heartbeats (and whatever optional message the worker queued) until hung
    up, and `leave` (then half-close) once the worker closes with a reason."""
    yield afd_pb2.SessionRequest(register=register)
    heartbeat = afd_pb2.SessionRequest(heartbeat=afd_pb2.Heartbeat())
    outbox = outbox if outbox is not None else queue.Queue()
    next_beat = time.monotonic() + beat_s
    while True:
        item: afd_pb2.SessionRequest | None = None
        if not hung_up.is_set():
            try:
                item = outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                pass
        hung = hung_up.is_set()
        reason = leaving()
        if reason:
            yield afd_pb2.SessionRequest(leave=afd_pb2.Leave(reason=reason))
            return
        if hung:
            return
        if item is not None:
            yield item
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + beat_s
            yield heartbeat


class _Watchdog:
    """Cancels a session call when the daemon has said nothing for `timeout_s`, counting only
    time in which this process ran Python: when its own wake-up comes late (this process was
    busy, e.g. compiling, and read nothing either), the silence so far is not the daemon's."""

    def __init__(self, call: grpc.Call, timeout_s: float) -> None:
        self._call = call
        self._timeout_s = timeout_s
        self._last = time.monotonic()
        self._done = threading.Event()
        self.fired = False
        named_thread(self._run, "afd-session-watchdog", os_name="afd-link-watch").start()

    def heard(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        period = self._timeout_s / 4
        woke = time.monotonic()
        while not self._done.wait(period):
            now = time.monotonic()
            if now - woke > 2 * period:
                self._last = max(self._last, now - period)  # starved: not the daemon's silence
            woke = now
            if now - self._last > self._timeout_s:
                self.fired = True
                self._call.cancel()
                return
