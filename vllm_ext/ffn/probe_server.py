"""The FFN server's `/health` and `/metrics` over HTTP, on one thread with bounded work.

Probes and scrapes are tiny GET requests, but anyone who reaches the port can open connections
and leave them idle, or hang up half-way. The standard library's threading server keeps a
thread per connection for as long as the client stays (300 idle connections: 302 threads) and
prints a traceback for every client that resets its connection. This one multiplexes every
connection on one thread (selectors): a connection has REQUEST_TIMEOUT_S to send its request
and take the answer, at most MAX_CONNECTIONS are open (the oldest goes first, so a probe still
gets in under a flood), a request header is at most MAX_REQUEST_BYTES, each answer closes its
connection, and a client that hangs up is a debug line, never a traceback.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from afd_ctl.threads import named_thread

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
# The loop wakes at least this often to close connections past their deadline.
TICK_S = 0.25

# An answer: (HTTP status, Content-Type, body).
Answer = tuple[int, str, bytes]
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class _Connection:
    sock: socket.socket
    deadline: float
    received: bytes = b""
    answer: bytes = b""  # what is left to send, once the request is read
    sent: int = 0
    opened: float = field(default_factory=time.monotonic)


class ProbeServer:
    """Serves GET (and HEAD) of the given paths on host:port from a daemon thread."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[], Answer]]) -> None:
        """Binds at once (raises OSError when it cannot); `start()` begins serving."""
        self.routes = routes
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._open: dict[int, _Connection] = {}
        self._closed = threading.Event()
        self._thread = named_thread(self._serve, "afd-ffn-probes")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * TICK_S + 1)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                for key, events in self._selector.select(timeout=TICK_S):
                    if key.data is None:
                        self._accept()
                    elif events & selectors.EVENT_READ:
                        self._read(key.data)
                    else:
                        self._write(key.data)
                self._expire(time.monotonic())
        except Exception:  # never expected: say so once, the FFN server itself goes on
            log.exception("afd ffn: the /health and /metrics server stopped")
        finally:
            for conn in list(self._open.values()):
                self._drop(conn)
            self._selector.close()
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: try again at the next event
                log.debug("afd ffn probes: accept: %s", exc)
                return
            sock.setblocking(False)
            if len(self._open) >= MAX_CONNECTIONS:
                oldest = min(self._open.values(), key=lambda c: c.opened)
                self._drop(oldest)
            conn = _Connection(sock, time.monotonic() + REQUEST_TIMEOUT_S)
            self._open[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # reset by the client
            log.debug("afd ffn probes: client went away: %s", exc)
            self._drop(conn)
            return
        if not chunk:  # the client hung up before its request was complete
            self._drop(conn)
            return
        conn.received += chunk
        end = conn.received.find(b"\r\n\r\n")
        if end < 0:
            end = conn.received.find(b"\n\n")
        if end < 0:
            if len(conn.received) > MAX_REQUEST_BYTES:
                self._answer(conn, (431, "text/plain", b"request header too large\n"), True)
            return
        self._answer(conn, *self._route(conn.received[:end]))

    def _route(self, head: bytes) -> tuple[Answer, bool]:
        """(the answer, whether to send its body) for a request head."""
        parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return (400, "text/plain", b"bad request\n"), True
        method, target = parts[0], parts[1].split(b"?", 1)[0].decode("latin-1")
        if method not in (b"GET", b"HEAD"):
            return (405, "text/plain", b"GET or HEAD only\n"), True
        route = self.routes.get(target)
        if route is None:
            return (404, "text/plain", b"not found: try /health or /metrics\n"), True
        try:
            answer = route()
        except Exception as exc:
            log.warning("afd ffn probes: %s failed: %s: %s", target, type(exc).__name__, exc)
            answer = (500, "text/plain", f"{type(exc).__name__}\n".encode())
        return answer, method == b"GET"

    def _answer(self, conn: _Connection, answer: Answer, with_body: bool) -> None:
        status, content_type, body = answer
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        conn.answer = head + body if with_body else head
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        try:
            conn.sent += conn.sock.send(conn.answer[conn.sent :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("afd ffn probes: client went away: %s", exc)
            self._drop(conn)
            return
        if conn.sent >= len(conn.answer):
            self._drop(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._open.values() if c.deadline <= now]:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        self._open.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
