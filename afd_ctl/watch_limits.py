"""Bounds on the streams that only watch the daemon: health `Watch` and `Tap`.

A health Watch needs no token (load balancers probe health bare), so anyone who reaches the
port could open streams until the daemon runs out of memory; each costs the daemon about
20 KiB while open. They are counted per client host and in total, and one over either bound
is refused with RESOURCE_EXHAUSTED saying which. Taps (`afd-ctl watch`) need the token when
the daemon has one, and have a budget of their own (issue 39): anonymous health Watch streams,
however many, never lock an operator out. When many have closed, the daemon hands the freed
heap back to the operating system (glibc keeps it otherwise).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from afd_ctl.logs import RateLimitedLog

log = logging.getLogger(__name__)
REFUSED = RateLimitedLog(log, "watch stream refused")
# Heap is trimmed once this many watch streams have closed (or all have), a second later.
TRIM_AFTER_CLOSED = 64
TRIM_DELAY_S = 1.0


def client_host(peer: str) -> str:
    """The host part of a grpc peer string ("ipv4:10.0.0.7:5123" -> "ipv4:10.0.0.7",
    "ipv6:[::1]:5123" -> "ipv6:[::1]"); a unix socket's peer as it is."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


@dataclass(frozen=True)
class StreamKind:
    """What a budget counts, for its refusals: the stream's name, its two flags, a way out."""

    name: str
    total_flag: str
    per_client_flag: str
    instead: str


HEALTH_WATCH = StreamKind(
    "health Watch",
    "--max-watch-streams",
    "--max-watch-streams-per-client",
    "close some, or poll Health/Check instead",
)
TAP = StreamKind(
    "Tap", "--max-tap-streams", "--max-tap-streams-per-client", "close some (afd-ctl watch)"
)


class WatchLimits:
    """Open streams of one kind per client host and in total (plain Python, on the event
    loop). Each kind has its own: health Watch streams and Taps never share a budget."""

    def __init__(self, total: int, per_client: int, kind: StreamKind = HEALTH_WATCH) -> None:
        self.total = total
        self.per_client = per_client
        self.kind = kind
        self._open: Counter[str] = Counter()
        self._closed_since_trim = 0
        self._trim = _malloc_trim()
        self._trim_pending = False
        self.trims = 0

    @property
    def open(self) -> int:
        return sum(self._open.values())

    def acquire(self, peer: str) -> str | None:
        """Counts a new stream from `peer`; or, over a bound, returns why it is refused."""
        host = client_host(peer)
        kind = self.kind
        if self._open[host] >= self.per_client:
            return (
                f"too many open {kind.name} streams from {host}: {self.per_client} "
                f"({kind.per_client_flag}); {kind.instead}"
            )
        if self.open >= self.total:
            return (
                f"too many open {kind.name} streams on this daemon: {self.total} "
                f"({kind.total_flag}); {kind.instead}"
            )
        self._open[host] += 1
        return None

    def release(self, peer: str) -> None:
        host = client_host(peer)
        self._open[host] -= 1
        if self._open[host] <= 0:
            del self._open[host]  # no entry left behind per client that ever connected
        self._closed_since_trim += 1
        if self._closed_since_trim >= TRIM_AFTER_CLOSED or not self._open:
            self._schedule_trim()

    def _schedule_trim(self) -> None:
        if self._trim is None or self._trim_pending or self._closed_since_trim == 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._trim_pending = True
        loop.call_later(TRIM_DELAY_S, self._trim_now)

    def _trim_now(self) -> None:
        """Gives the heap freed by closed streams back to the OS (the cost: a few ms)."""
        self._trim_pending = False
        self._closed_since_trim = 0
        if self._trim is not None:
            self._trim(0)
            self.trims += 1


async def refuse(context: grpc.aio.ServicerContext, why: str) -> None:
    REFUSED.warn(f"from {context.peer()}: {why}")
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)


class BoundedHealthServicer(health.aio.HealthServicer):
    """grpc's health servicer, with Watch streams counted in `limits`."""

    def __init__(self, limits: WatchLimits) -> None:
        super().__init__()
        self.limits = limits

    async def Watch(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        peer = context.peer()
        why = self.limits.acquire(peer)
        if why is not None:
            await refuse(context, why)
            return
        try:
            await super().Watch(request, context)
        except (grpc.aio.InternalError, grpc.aio.UsageError, asyncio.InvalidStateError):
            return  # the client hung up during a blocked write: an ordinary end
        finally:
            self.limits.release(peer)
