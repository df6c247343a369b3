"""The attention sender's PublishBatch stream: one long-lived stream fed by a queue.

`publish` never blocks the step; refusals come back as acks and surface as typed errors on the
next call. A new registration retires the stream (it is bound to the old session's secret).

Payloads go in batches: each gRPC message costs the sender's host several takes of the
interpreter lock by grpcio's threads (more than the step's own bookkeeping), taken from the
engine's thread. The stream's thread sends what queued since its last message; with a
coalescing window (`window`, which the data plane sets while afd-ctl's copy is off the
step's path: every FFN subscriber takes the payloads directly) it first waits that long after
the first payload, so a few steps go in one message.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from afd_ctl.errors import AfdRejected, AfdStaleEpoch, AfdTimeout
from afd_ctl.session_link import PERMANENT_CODES
from afd_ctl.threads import name_os_thread, named_thread
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.wire import PUBLISH_SECRET_METADATA, WORKER_ID_METADATA

log = logging.getLogger(__name__)

Reason = afd_pb2.PublishRejected.Reason
# Refusals that mean "your view is out of date": refresh it (wait_complete) and resend.
STALE_REASONS = (Reason.STALE_EPOCH, Reason.SESSION_ENDED)
Requests = queue.SimpleQueue[afd_pb2.AFDControlPayload | None]
# Payloads in one message at most (a few hundred bytes each).
MAX_BATCH = 64


def rejection(rejected: afd_pb2.PublishRejected) -> AfdRejected:
    code = rejected.code
    name = next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
    if rejected.reason in STALE_REASONS:
        return AfdStaleEpoch(rejected.message, code=name)
    return AfdRejected(name, rejected.message)


class _Stream:
    """One Publish call: its request queue, and events for the call's end and its acks read."""

    def __init__(self, requests: Requests, call: grpc.Call) -> None:
        self.requests = requests
        self.call = call
        self.ended = threading.Event()
        self.acks_read = threading.Event()
        call.add_done_callback(lambda _call: self.ended.set())  # type: ignore[attr-defined]


class Publisher:
    """Publishes payloads for one registered attention worker.

    `lock` must be taken before the view's lock when both are needed (a registration retires
    the stream under both, so no stream opens with the old secret once the new one is here)."""

    def __init__(
        self,
        stub: afd_pb2_grpc.AFDControllerStub,
        metadata: tuple[tuple[str, str], ...],
        worker_id: str,
        secret: Callable[[], str],
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._worker_id = worker_id
        self._secret = secret
        self.lock = threading.Lock()
        self._rejections: deque[AfdRejected] = deque()
        self._last_put = 0  # the last step id queued
        self._discarded_upto = 0  # refusals of steps up to this one are about older payloads
        self._stream: _Stream | None = None  # guarded by lock
        # Seconds the stream's thread waits after a payload for more (0: sends at once).
        self.window: Callable[[], float] = lambda: 0.0
        self.sent = Sent()

    def raise_rejection(self) -> None:
        """Raises the oldest refusal not yet raised, if any."""
        if self._rejections:
            raise self._rejections.popleft()

    def discard_rejections(self) -> None:
        """Drops the refusals of every payload queued so far, also those still to come back
        (a payload may wait in the stream's window while the worker reconnects)."""
        self._discarded_upto = self._last_put
        self._rejections.clear()

    def put(self, payload: afd_pb2.AFDControlPayload) -> None:
        self._last_put = payload.step_id
        self._open().requests.put(payload)

    def _open(self) -> _Stream:
        with self.lock:
            if self._stream is not None:
                return self._stream
            requests: Requests = queue.SimpleQueue()
            metadata = (
                *self._metadata,
                (WORKER_ID_METADATA, self._worker_id),
                (PUBLISH_SECRET_METADATA, self._secret()),
            )
            batches = _batches(requests, lambda: self.window(), self.sent)
            call = self._stub.PublishBatch(batches, metadata=metadata)
            stream = self._stream = _Stream(requests, call)
            named_thread(self._read_acks, "afd-publish-acks", (stream,)).start()
            return stream

    def retire(self) -> None:
        """Half-closes the stream (call with `lock` held); the next publish opens a new one."""
        if self._stream is not None:
            self._stream.requests.put(None)
        self._stream = None

    def _is_current(self, stream: _Stream) -> bool:
        with self.lock:
            return self._stream is stream

    def _read_acks(self, stream: _Stream) -> None:
        try:
            for ack in stream.call:  # type: ignore[attr-defined]
                refused = ack.rejected
                # A retired stream's are about an old session, a discarded one's about
                # payloads from before a reconnect.
                if self._is_current(stream) and refused.step_id > self._discarded_upto:
                    self._rejections.append(rejection(refused))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning("publish stream ended: %s: %s", exc.code().name, exc.details())
                if exc.code() in PERMANENT_CODES and self._is_current(stream):
                    self._rejections.append(AfdRejected(exc.code().name, exc.details() or ""))
        finally:
            with self.lock:
                if self._stream is stream:
                    self._stream = None
            stream.requests.put(None)
            stream.acks_read.set()

    def flush(self, timeout_s: float) -> None:
        """Half-closes the stream, waits until the daemon has read everything and its acks
        are in; raises the first rejection, if any."""
        with self.lock:
            stream = self._stream
        if stream is None:
            self.raise_rejection()
            return
        stream.requests.put(None)
        if not stream.ended.wait(timeout_s):
            raise AfdTimeout(f"publish stream not drained within {timeout_s:.1f} s")
        # The acks reader appends what it read right after the call ends.
        stream.acks_read.wait(timeout_s)
        self.raise_rejection()

    def close(self) -> None:
        with self.lock:
            if self._stream is not None:
                self._stream.requests.put(None)


class Sent:
    """Messages and payloads a publisher's streams sent (written by the stream's thread)."""

    def __init__(self) -> None:
        self.messages = 0
        self.payloads = 0

    def stats(self) -> dict[str, float]:
        if not self.messages:
            return {}
        return {"publish_payloads_per_message": round(self.payloads / self.messages, 2)}


def _batches(
    requests: Requests, window: Callable[[], float], sent: Sent
) -> Iterator[afd_pb2.AFDControlPayloads]:
    """The stream's messages: what queued, in order, at most MAX_BATCH payloads each; ends at
    the None that half-closes the stream (after the payloads queued before it)."""
    name_os_thread("afd-publish")  # it runs on grpcio's thread that reads the request iterator
    while True:
        first = requests.get()
        if first is None:
            return
        wait_s = window()
        if wait_s > 0:
            time.sleep(wait_s)  # the queue is read after it: no wake-up per payload meanwhile
        batch, ended = [first], False
        while len(batch) < MAX_BATCH:
            try:
                item = requests.get_nowait()
            except queue.Empty:
                break
            if item is None:
                ended = True
                break
            batch.append(item)
        sent.messages += 1
        sent.payloads += len(batch)
        yield afd_pb2.AFDControlPayloads(payloads=batch)
        if ended:
            return
