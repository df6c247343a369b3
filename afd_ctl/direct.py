"""Step payloads straight from an attention sender to its FFN workers on the same host.

afd-ctl relays every AFDControlPayload (attention -> daemon -> FFN: two gRPC hops through
Python, 1.2-1.7 ms on a busy H200 host). When the attention host does not run a step ahead of
its GPU (batch 256 there), the FFN side learnt each step's shape after the attention GPU had
started it, and the attention GPU idled on the relay. So the sender also writes each payload
(`DirectPayload`, protobuf) to each of its FFN subscribers on its host over an abstract Unix
datagram socket: tens of microseconds, no daemon. The daemon still receives, checks, relays and
taps every payload; the direct copy only arrives first.

A datagram can be dropped (the receiver's queue is full; a peer in another network namespace
cannot be reached at all), never reordered. `StepChain` therefore runs a direct payload only
once the payload its sender published before it (`prev_step_id`, in the same epoch) has run,
from either path, and skips the second copy of each step: steps run once each, in the order
published, whichever path brings them first.

Names are "afd-steps-<boot id>-<random>": a worker on another host never matches, and a
receiver takes datagrams only from its view's attention peers' names (the sender binds its own
name, which no other process can bind while it lives). Linux only; elsewhere the relay only.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import select
import socket
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from google.protobuf.message import DecodeError

from afd_ctl import routing
from afd_ctl.v1 import afd_pb2

log = logging.getLogger(__name__)

PREFIX = "afd-steps-"
MAX_NAME_CHARS = 100
_NAME = re.compile(r"afd-steps-[0-9a-f]{32}-[0-9a-f]{16}")
# A payload is a few hundred bytes; anything larger is not ours.
MAX_DATAGRAM_BYTES = 64 << 10
# Direct payloads that arrived before their predecessor, kept per receiver.
MAX_HELD = 64
# While every subscriber of a sender takes its payloads directly, afd-ctl's copies are a
# backup (a dropped datagram) and for operators: the sender's publish stream may hold one for
# this long to send several steps in one message (afd_ctl.publisher). 20 ms gave 2.6 steps a
# message and 57-176 us of the attention engine's CPU per step on an H100 host (2026-12-06).
RELAY_COALESCE_S = 0.05


def supported() -> bool:
    return sys.platform.startswith("linux")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    except OSError:
        return ""


def socket_problem(name: str) -> str | None:
    """Why `name` cannot be a worker's step socket (None: it can, or it is "": none)."""
    if not name:
        return None
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    if not _NAME.fullmatch(name):
        return f'is not "{PREFIX}<32 hex digits of the boot id>-<16 hex digits>"'
    return None


def same_host(name: str) -> bool:
    """`name` was made on this host (since its last boot)."""
    host = boot_id()
    return bool(host) and socket_problem(name) is None and name[len(PREFIX) : -17] == host


def subscriber_ranks(view: afd_pb2.View, sender_rank: int) -> list[int]:
    """The FFN ranks afd-ctl relays an attention sender's payloads to in `view`."""
    return routing.subscriber_ranks(
        sender_rank, view.expected_attention, view.expected_ffn, groups=view.ffn_groups or None
    )


def subscriber_sockets(view: afd_pb2.View, sender_rank: int) -> dict[str, str]:
    """An attention sender's FFN subscribers in `view` (those afd-ctl relays its payloads
    to) that have a step socket: worker id -> socket name."""
    ranks = subscriber_ranks(view, sender_rank)
    return {
        p.worker.worker_id: p.worker.step_socket
        for p in view.peers
        if p.worker.step_socket and p.worker.role_rank in ranks
    }


def peer_sockets(view: afd_pb2.View) -> list[str]:
    """The step sockets of the peers in `view` (an FFN worker's: its attention peers)."""
    return [p.worker.step_socket for p in view.peers if p.worker.step_socket]


class StepSocket:
    """This worker's bound, non-blocking abstract datagram socket."""

    def __init__(self) -> None:
        host = boot_id()
        if not supported() or len(host) != 32:
            raise OSError("direct step payloads need Linux (abstract Unix sockets, a boot id)")
        self.name = f"{PREFIX}{host}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setblocking(False)
        self.sock.bind("\0" + self.name)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


class DirectSender:
    """An attention sender's side: one datagram per published payload to each FFN subscriber
    on this host. Never blocks and never raises: a full queue drops that copy (counted), a
    peer that cannot be reached is given up until the next `connect`."""

    def __init__(self, sock: StepSocket) -> None:
        self.sock = sock
        self._targets: dict[str, str] = {}  # worker id -> socket name
        self._subscribers = 0  # of the view, with or without a socket here
        self._epoch: int | None = None
        self._prev = 0
        self.sent = 0
        self.dropped = 0

    def connect(self, targets: Mapping[str, str], subscribers: int = 0) -> None:
        """The FFN subscribers of the new view (worker id -> step socket) on this host, of
        the view's `subscribers`."""
        self._targets = {w: name for w, name in targets.items() if same_host(name)}
        self._subscribers = subscribers
        if self._targets:
            log.info(
                "afd direct payloads: each step payload also goes straight to %s on this host "
                "(afd-ctl relays it as well)",
                ", ".join(sorted(self._targets)),
            )

    @property
    def covers_all(self) -> bool:
        """Every subscriber of the view is a target (none given up since)."""
        return 0 < self._subscribers == len(self._targets)

    @property
    def targets(self) -> list[str]:
        return sorted(self._targets)

    def send(self, payload: afd_pb2.AFDControlPayload) -> None:
        """After the payload was queued for afd-ctl (stamped with its epoch)."""
        if payload.stop:
            return
        if payload.epoch != self._epoch:
            self._epoch, self._prev = payload.epoch, 0
        prev, self._prev = self._prev, payload.step_id
        if not self._targets:
            return
        data = afd_pb2.DirectPayload(payload=payload, prev_step_id=prev).SerializeToString()
        for worker_id, name in list(self._targets.items()):
            try:
                self.sock.sock.sendto(data, "\0" + name)
                self.sent += 1
            except BlockingIOError:
                self.dropped += 1  # its queue is full: the relay brings this one
            except OSError as exc:
                del self._targets[worker_id]
                log.warning(
                    "afd direct payloads: %s cannot be reached on this host (%s: another "
                    "network namespace, or it exited); its payloads come through afd-ctl only",
                    worker_id,
                    exc,
                )


class StepChain:
    """The order in which an FFN worker runs payloads that come twice: relayed by afd-ctl (each
    accepted payload, in order) and direct (any of them may be missing). Free of sockets."""

    def __init__(self) -> None:
        # (epoch, sender rank) -> the last step id taken from either path.
        self._last: dict[tuple[int, int], int] = {}
        # (epoch, sender rank, prev step id) -> a direct payload waiting for its predecessor.
        self._held: dict[tuple[int, int, int], afd_pb2.AFDControlPayload] = {}

    def _key(self, payload: afd_pb2.AFDControlPayload) -> tuple[int, int]:
        return payload.epoch, payload.sender_role_rank

    def relayed(self, payload: afd_pb2.AFDControlPayload) -> bool:
        """True: hand this relayed payload to the caller (it has not run); False: its direct
        copy ran already. A stop, or a payload of another epoch, is always handed on."""
        if payload.stop:
            return True
        last = self._last.get(self._key(payload))
        if last is not None and payload.step_id <= last:
            return False
        self._taken(payload)
        return True

    def direct(self, msg: afd_pb2.DirectPayload) -> None:
        payload = msg.payload
        last = self._last.get(self._key(payload), 0)
        if payload.step_id <= last:
            return  # its relayed copy came first
        if len(self._held) >= MAX_HELD:
            self._held.pop(next(iter(self._held)))
        self._held[(*self._key(payload), msg.prev_step_id)] = payload

    def ready(self, epoch: int) -> afd_pb2.AFDControlPayload | None:
        """The next direct payload of `epoch` (the worker's data plane's) whose predecessor
        has run, marked as taken; None when there is none."""
        for (e, sender, prev), payload in self._held.items():
            if e == epoch and self._last.get((e, sender), 0) == prev:
                del self._held[(e, sender, prev)]
                self._taken(payload)
                return payload
        return None

    def _taken(self, payload: afd_pb2.AFDControlPayload) -> None:
        key, epoch = self._key(payload), payload.epoch
        self._last[key] = payload.step_id
        for old in [k for k in self._last if k[0] < epoch - 1]:
            del self._last[old]
        for held_key, held in list(self._held.items()):
            if held_key[0] < epoch or (held_key[:2] == key and held.step_id <= payload.step_id):
                del self._held[held_key]


class DirectInbox:
    """An FFN worker's side: datagrams from its view's attention peers only, decoded into the
    chain; `wait` also wakes when `wake()` is called (a relayed payload came)."""

    def __init__(self, sock: StepSocket) -> None:
        self.sock = sock
        self.chain = StepChain()
        self._senders: frozenset[bytes] = frozenset()
        self._wake_r, self._wake_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self.received = 0
        self.refused = 0

    def allow(self, senders: Iterable[str]) -> None:
        """The step sockets of this view's attention peers on this host."""
        # recvfrom names an abstract address as bytes that start with a NUL.
        allowed = frozenset(b"\0" + s.encode() for s in senders if same_host(s))
        if allowed and allowed != self._senders:
            log.info(
                "afd direct payloads: step payloads of %d attention peer(s) on this host come "
                "straight from them too (afd-ctl relays them as well)",
                len(allowed),
            )
        self._senders = allowed

    @property
    def active(self) -> bool:
        return bool(self._senders)

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def wait(self, timeout_s: float) -> None:
        """Until a datagram or a wake comes, or `timeout_s` passed; takes what came."""
        ready, _, _ = select.select([self.sock.sock, self._wake_r], [], [], max(0.0, timeout_s))
        if self._wake_r in ready:
            with contextlib.suppress(OSError):
                while self._wake_r.recv(64):
                    pass
        if self.sock.sock in ready:
            self.take()

    def take(self) -> None:
        while True:
            try:
                data, source = self.sock.sock.recvfrom(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if source not in self._senders:
                self.refused += 1
                continue
            msg = afd_pb2.DirectPayload()
            try:
                msg.ParseFromString(data)
            except DecodeError:
                self.refused += 1
                continue
            self.received += 1
            self.chain.direct(msg)

    def close(self) -> None:
        for end in (self._wake_r, self._wake_w):
            end.close()
