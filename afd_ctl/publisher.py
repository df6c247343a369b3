"""The attention sender's Publish stream: one long-lived stream fed by a queue.

`publish` never blocks the step; refusals come back as acks and surface as typed errors on the
next call. A new registration retires the stream (it is bound to the old session's secret).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from afd_ctl.errors import AfdRejected, AfdStaleEpoch, AfdTimeout
from afd_ctl.session_link import PERMANENT_CODES
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.wire import PUBLISH_SECRET_METADATA, WORKER_ID_METADATA

log = logging.getLogger(__name__)

Reason = afd_pb2.PublishRejected.Reason
# Refusals that mean "your view is out of date": refresh it (wait_complete) and resend.
STALE_REASONS = (Reason.STALE_EPOCH, Reason.SESSION_ENDED)
Requests = queue.SimpleQueue[afd_pb2.AFDControlPayload | None]


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
        self._stream: _Stream | None = None  # guarded by lock

    def raise_rejection(self) -> None:
        """Raises the oldest refusal not yet raised, if any."""
        if self._rejections:
            raise self._rejections.popleft()

    def discard_rejections(self) -> None:
        self._rejections.clear()

    def put(self, payload: afd_pb2.AFDControlPayload) -> None:
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
            call = self._stub.Publish(_drain(requests), metadata=metadata)
            stream = self._stream = _Stream(requests, call)
            threading.Thread(
                target=self._read_acks, args=(stream,), name="afd-publish-acks", daemon=True
            ).start()
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
                if self._is_current(stream):  # a retired stream's are about an old session
                    self._rejections.append(rejection(ack.rejected))
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


def _drain(requests: Requests) -> Iterator[afd_pb2.AFDControlPayload]:
    while True:
        item = requests.get()
        if item is None:
            return
        yield item
