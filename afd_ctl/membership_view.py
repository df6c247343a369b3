"""What one worker knows of the membership: its registration, the current view, the payloads
and losses in stream order, and whether it is stopped, unreachable or refused.

Plain Python with no gRPC: the session link feeds it messages, the caller waits on it. One
condition guards everything, so every `wait_*` sees a consistent state and is bounded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from afd_ctl.errors import (
    AfdControllerUnreachable,
    AfdError,
    AfdNotReady,
    AfdPeerLost,
    AfdStopped,
    AfdTimeout,
)
from afd_ctl.v1 import afd_pb2

log = logging.getLogger(__name__)

Kind = afd_pb2.MembershipEvent.Kind
Inbound = afd_pb2.AFDControlPayload | AfdError


class MembershipView:
    """The worker's view of afd-ctl; `target` only names the daemon in messages."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.cond = threading.Condition()
        self._payloads: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        # Guarded by cond:
        self.registered_msg: afd_pb2.Registered | None = None
        self.current: afd_pb2.View | None = None
        self.unreachable: AfdControllerUnreachable | None = None
        self.fatal: AfdError | None = None
        self.stopped: AfdStopped | None = None
        self.closing = False
        self._drained = False
        self._lost: AfdPeerLost | None = None
        self._was_complete = False
        # Epoch of the last complete view handed to the caller by wait_complete().
        self._acknowledged_epoch = 0
        # Called after anything is queued for next_payload (a reader that also waits on
        # something else, vllm_ext.ffn.payloads, wakes on it).
        self.on_inbound: Callable[[], None] | None = None

    def _put(self, item: Inbound) -> None:
        self._payloads.put(item)
        wake = self.on_inbound
        if wake is not None:
            wake()

    # -- fed by the session link (each call takes the lock) -----------------------------
    def on_registered(self, registered: afd_pb2.Registered) -> bool:
        """A (re-)registration; True when it is a re-registration. Call with `cond` held."""
        again = self.registered_msg is not None
        self.registered_msg = registered
        self.current = registered.view
        self.unreachable = None
        self._drained = False  # a new daemon (or the same one again) is not draining
        self._note_view()
        self.cond.notify_all()
        return again

    def on_event(self, event: afd_pb2.MembershipEvent) -> None:
        """A membership event: the new view, and a loss queued in stream order."""
        with self.cond:
            self.current = event.view
            if event.kind == Kind.PEER_LOST:
                lost = event.worker
                self._lost = AfdPeerLost(
                    f"{afd_pb2.Role.Name(lost.role).lower()} rank "
                    f"{lost.role_rank} ({lost.worker_id}): {event.reason}; now epoch "
                    f"{event.view.epoch}, waiting for a replacement",
                    epoch=event.view.epoch,
                )
                self._put(self._lost)
            if event.kind in (Kind.STOP, Kind.DAEMON_DRAINING):
                self._drained = True
            self._note_view()
            self.cond.notify_all()

    def on_payload(self, payload: afd_pb2.AFDControlPayload) -> None:
        self._put(payload)

    def on_unreachable(self, error: AfdControllerUnreachable, *, was_registered: bool) -> None:
        """The session broke (or never came up); a registered worker's reader hears of it."""
        with self.cond:
            self.unreachable = error
            if was_registered:
                self._put(error)
            self.cond.notify_all()

    def on_fatal(self, error: AfdError) -> None:
        with self.cond:
            self.fatal = error
            self._put(error)  # wakes a reader blocked in next_payload
            self.cond.notify_all()

    def stop(self, reason: str) -> bool:
        """Stopped for good; True the first time."""
        with self.cond:
            if self.stopped is not None:
                return False
            self.stopped = AfdStopped(reason)
            self._put(self.stopped)
            self.cond.notify_all()
        log.info("stopped: %s", reason)
        return True

    def _note_view(self) -> None:
        if self.current is not None and self.current.complete:
            self._was_complete = True
            self._lost = None

    # -- read by the caller --------------------------------------------------------------
    def wait_registered(self, timeout_s: float) -> afd_pb2.Registered:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.registered_msg is None:
                if self.fatal is not None:
                    raise self.fatal
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = f": {self.unreachable}" if self.unreachable else ""
                    raise AfdTimeout(
                        f"could not register with afd-ctl at {self.target} within "
                        f"{timeout_s:.1f} s{why}; is `afd-ctl serve` running there?"
                    )
                self.cond.wait(remaining)
            return self.registered_msg

    def wait_complete(self, timeout_s: float, after_epoch: int = 0) -> afd_pb2.View:
        """Blocks until every expected worker is registered in an epoch newer than
        `after_epoch`; returns that view."""

        def ready(view: afd_pb2.View) -> bool:
            if not view.complete or view.hold or view.pending or view.epoch <= after_epoch:
                # A planned change's fence, or a worker registered for its target and not
                # routed yet: the view after the change is the one.
                return False
            if self.unreachable is not None:
                return False
            # The caller has seen this epoch: older payloads and losses are history.
            self._acknowledged_epoch = max(self._acknowledged_epoch, view.epoch)
            return True

        return self._wait_view(
            timeout_s, ready, lambda: self.incomplete_message(f"after {timeout_s:.1f} s")
        )

    def wait_unheld(self, timeout_s: float) -> afd_pb2.View:
        """Blocks while the current view says `hold` (issue 37: a planned change at its
        fence); returns the view that lifted it (SCALED: a new epoch; CHANGE_ABORTED or a loss:
        the same or a newer one, possibly incomplete)."""
        return self._wait_view(
            timeout_s,
            lambda view: not view.hold or self.unreachable is not None,
            lambda: (
                f"afd-ctl at {self.target} held this worker for a planned change for "
                f"{timeout_s:.1f} s without moving to its new epoch or giving it up "
                "(afd-ctl status shows the change)"
            ),
        )

    def _wait_view(
        self,
        timeout_s: float,
        ready: Callable[[afd_pb2.View], bool],
        timed_out: Callable[[], str],
    ) -> afd_pb2.View:
        """Blocks until the current view is `ready` (checked under the lock); a fatal error or
        a stop raises at once, the bound raises AfdTimeout(timed_out())."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                if self.fatal is not None:
                    raise self.fatal
                if self.stopped is not None:
                    raise self.stopped
                view = self.current
                if view is not None and ready(view):
                    return view
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AfdTimeout(timed_out())
                self.cond.wait(remaining)

    def wait_drained(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not self._drained and self.fatal is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(remaining)
            return self._drained

    def wait_stopped(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.stopped is None and self.fatal is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(remaining)
            return self.stopped is not None

    def serving(self) -> bool:
        """Registered, afd-ctl reachable, not stopped, and the expected set complete: what a
        worker's readiness needs from the control plane."""
        with self.cond:
            return (
                self.fatal is None
                and self.stopped is None
                and self.unreachable is None
                and self.current is not None
                and self.current.complete
            )

    def incomplete_message(self, when: str) -> str:
        if self.unreachable is not None:
            return f"{self.unreachable} ({when})"
        view = self.current
        if view is None:
            return f"not registered with afd-ctl at {self.target} {when}"
        return (
            f"the expected set ({view.expected_attention} attention, {view.expected_ffn} ffn) "
            f"is incomplete {when}; `afd-ctl status --controller {self.target}` shows who is "
            "missing"
        )

    def view(self) -> afd_pb2.View:
        with self.cond:
            if self.current is None:
                raise AfdNotReady("not registered yet: call connect() first")
            return self.current

    def registered(self) -> afd_pb2.Registered:
        with self.cond:
            if self.registered_msg is None:
                raise AfdNotReady("not registered yet: call connect() first")
            return self.registered_msg

    def next_payload(self, timeout_s: float) -> afd_pb2.AFDControlPayload:
        """The next payload, in order, or the typed error that came in its place.

        A set that is not complete yet (and was not complete before, so nothing was lost) is
        waited for within ``timeout_s``: the first payload of an epoch can reach this worker
        just before the view that says the set is complete."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self._payloads.get_nowait()
            except queue.Empty:
                self.raise_condition(wait_for_completion=True)
                try:
                    item = self._payloads.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self.raise_condition()
                    raise AfdTimeout(
                        f"no payload from afd-ctl within {timeout_s:.3f} s "
                        f"(epoch {self.current.epoch if self.current else '-'})"
                    ) from None
            if self._is_history(item):
                continue
            if isinstance(item, AfdError):
                raise item
            return item

    def poll_payload(self) -> afd_pb2.AFDControlPayload | None:
        """The next payload if one is queued (never waits, checks no condition), or the typed
        error queued in its place; None when nothing is."""
        while True:
            try:
                item = self._payloads.get_nowait()
            except queue.Empty:
                return None
            if self._is_history(item):
                continue
            if isinstance(item, AfdError):
                raise item
            return item

    def _is_history(self, item: Inbound) -> bool:
        """Payloads and losses from before the epoch the caller last waited for are dropped:
        the caller already reconnected past them."""
        acknowledged = self._acknowledged_epoch
        if isinstance(item, AfdPeerLost):
            return item.epoch is not None and item.epoch <= acknowledged
        if isinstance(item, AfdError):
            return False
        return item.epoch < acknowledged

    def raise_condition(self, wait_for_completion: bool = False) -> None:
        """Raises what keeps this worker from making progress now, if anything. With
        ``wait_for_completion`` a set that is still forming is not an error."""
        with self.cond:
            if self.fatal is not None:
                raise self.fatal
            if self.stopped is not None:
                raise self.stopped
            if self.closing:
                raise AfdError("the client is closed")
            if self.unreachable is not None:
                raise self.unreachable
            if self.current is None:
                raise AfdNotReady("not registered yet: call connect() first")
            if not self.current.complete:
                if self._lost is not None and self._was_complete:
                    raise self._lost
                if wait_for_completion:
                    return
                raise AfdNotReady(self.incomplete_message("now") + "; call wait_complete()")

    def stamp(self, payload: afd_pb2.AFDControlPayload) -> None:
        """Fills in the current epoch and this worker's role rank."""
        with self.cond:
            view, registered = self.current, self.registered_msg
        if view is None or registered is None:
            raise AfdNotReady("not registered yet: call connect() first")
        payload.epoch = view.epoch
        payload.sender_role_rank = registered.worker.role_rank
