"""The FFN server's /health + /metrics server under abuse (issue 39, item 4): clients that hang
up early or reset the connection leave no traceback, idle connections hold no thread each and
cannot keep a probe out, and the answers stay right. The real server function
(`vllm_ext.metrics.serve_ffn_metrics`) in this process; no vLLM needed."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import urllib.request

import pytest

from vllm_ext.ffn import probe_server
from vllm_ext.metrics import serve_ffn_metrics
from vllm_ext.testing.procs import free_port


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def reset(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.fixture
def served(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    port = free_port()
    metrics = serve_ffn_metrics("127.0.0.1", port)
    yield metrics, f"http://127.0.0.1:{port}"


def test_health_follows_the_connection_and_the_control_plane(served) -> None:
    metrics, base = served
    assert get(base + "/health") == (503, "not connected to its attention peers\n")
    metrics.connected(7, reconnect=False)
    assert get(base + "/health") == (200, "connected\n")
    link = {"ok": True}
    metrics.follow(lambda: link["ok"])
    link["ok"] = False  # afd-ctl unreachable, or the set incomplete
    status, body = get(base + "/health")
    assert status == 503 and "afd-ctl" in body, body
    link["ok"] = True
    assert get(base + "/health")[0] == 200
    status, body = get(base + "/metrics")
    assert status == 200 and "afd_epoch 7.0" in body, body
    assert get(base + "/nope")[0] == 404


def test_resets_and_early_hang_ups_leave_no_traceback(
    served, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    metrics, base = served
    metrics.connected(1, reconnect=False)
    port = int(base.rsplit(":", 1)[1])
    for i in range(100):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 3 == 0:
            s.sendall(b"GET /metr")  # half a request, then a reset
        elif i % 3 == 1:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # asks, never reads
        reset(s)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\n" + b"X: " + b"a" * 20000)  # a header far too large
    assert b"431" in s.recv(1024)
    s.close()
    assert get(base + "/health") == (200, "connected\n")
    text = caplog.text + "".join(capfd.readouterr())
    assert "Traceback" not in text, text[-3000:]
    assert "ConnectionResetError" not in "".join(
        r.getMessage() for r in caplog.records if r.levelno >= logging.INFO
    )


def test_idle_connections_hold_no_thread_and_cannot_keep_a_probe_out(served) -> None:
    metrics, base = served
    metrics.connected(1, reconnect=False)
    port = int(base.rsplit(":", 1)[1])
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        # Every probe is answered at once while 300 connections say nothing.
        for _ in range(5):
            started = time.monotonic()
            assert get(base + "/health", timeout_s=2) == (200, "connected\n")
            assert time.monotonic() - started < 1.0
        assert threading.active_count() <= threads_before  # no thread per connection
    finally:
        for s in idle:
            s.close()


def test_an_idle_connection_is_closed_after_the_request_bound(served) -> None:
    _, base = served
    port = int(base.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(probe_server.REQUEST_TIMEOUT_S + 5)
    started = time.monotonic()
    assert s.recv(1) == b""  # closed by the server, not by the test
    took = time.monotonic() - started
    assert probe_server.REQUEST_TIMEOUT_S - 1 < took < probe_server.REQUEST_TIMEOUT_S + 2, took
    s.close()
