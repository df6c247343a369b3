"""What anonymous or misbehaving clients can make the daemon write (issue 22, item 4): no
tracebacks for a tap that hangs up mid-write, no line per refused registration, no forged
lines from a client's text, and client text quoted at 200 characters."""

from __future__ import annotations

import re
import time

import grpc

from afd_ctl.client import ControllerClient
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

# A tap client that stops reading: a 1 KiB receive window, so the daemon's write to it
# blocks after a few dozen tiny payloads (tests/test_control_failures.py explains).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
# A log line the daemon writes starts with its timestamp.
LINE_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def client(address: str, worker_id: str, role: str) -> ControllerClient:
    c = ControllerClient(address, WorkerSpec(worker_id, role))
    c.connect(timeout_s=10)
    return c


def refused(stub: afd_pb2_grpc.AFDControllerStub, worker_id: str) -> grpc.RpcError:
    register = afd_pb2.RegisterRequest(role=afd_pb2.FFN, worker_id=worker_id, dp_size=1, tp_size=1)
    call = stub.Session(iter([afd_pb2.SessionRequest(register=register)]), timeout=10)
    try:
        list(call)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"registration of {worker_id!r} was accepted")


def test_taps_that_hang_up_mid_write_leave_no_traceback(start_daemon):
    """Twenty taps stop reading until the daemon's writes to them block, then hang up: the
    log has no traceback (grpcio logged each as a 10-line ERROR) and the workers carry on."""
    daemon = start_daemon("--subscriber-queue", "64")
    attn = client(daemon.address, "attn-0", ATTENTION)
    ffn = client(daemon.address, "ffn-0", FFN)
    channels = [grpc.insecure_channel(daemon.address, options=SMALL_WINDOW) for _ in range(20)]
    try:
        taps = [
            afd_pb2_grpc.AFDInspectStub(ch).Tap(afd_pb2.TapRequest(include_payloads=True))
            for ch in channels
        ]
        for tap in taps:
            tap.initial_metadata()  # subscribed
        attn.wait_complete(10)
        # More than a 1 KiB window holds, fewer than the 64 queued that would cut a tap off.
        for step in range(1, 61):
            attn.publish(make_payload(step, 1, 1))
            assert ffn.next_payload(5).step_id == step
        for tap in taps:
            tap.cancel()
        for ch in channels:
            ch.close()
        # The daemon sees the hang-ups; its status then lists no tap (Tap streams all ended).
        attn.publish(make_payload(61, 1, 1))
        assert ffn.next_payload(5).step_id == 61
        daemon.wait_for("worker registered: ffn", 5)
        with grpc.insecure_channel(daemon.address) as channel:
            inspect = afd_pb2_grpc.AFDInspectStub(channel)
            deadline = time.monotonic() + 10
            while inspect.GetStatus(afd_pb2.GetStatusRequest(), timeout=5).steps_relayed < 61:
                assert time.monotonic() < deadline
    finally:
        attn.close()
        ffn.close()
    log = daemon.log()
    assert "Traceback" not in log and "ExecuteBatchError" not in log, log[-3000:]


def test_refused_registrations_are_rate_limited_and_ids_cannot_forge_lines(start_daemon):
    """A worker id with a newline is refused naming the field; 400 refused registrations give
    about one line a second, not 400; a leave reason with a newline and 2,000 characters is
    logged (and told to peers) escaped and cut to 200 characters plus its length."""
    daemon = start_daemon("--expect-ffn", "1")
    forged = "ffn-9\n2026-12-01 00:00:00,000 INFO afd_ctl.controller: forged line"
    with grpc.insecure_channel(daemon.address) as channel:
        stub = afd_pb2_grpc.AFDControllerStub(channel)
        error = refused(stub, forged)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "worker_id has a control or invisible character (U+000A at index 5)" in error.details()
        )
        start = time.monotonic()
        for i in range(400):
            refused(stub, f"bad\tid-{i}")
        elapsed = time.monotonic() - start
    attn = client(daemon.address, "attn-0", ATTENTION)
    ffn = client(daemon.address, "ffn-0", FFN)
    try:
        attn.wait_complete(10)
        reason = "boom\nforged line " + "x" * 2000
        ffn.close(reason=reason)
        line = daemon.wait_for(r"peer lost: ffn rank 0 \(ffn-0\): left: (.*)", 10).group(1)
    finally:
        attn.close()
    assert line.startswith("boom\\nforged line xxx") and line.count("x") < 250
    assert f"...({len(reason)} chars)" in line
    lines = daemon.log().splitlines()
    assert all(LINE_START.match(line) for line in lines), lines[-20:]
    refusals = sum("registration refused" in line for line in lines)
    assert 1 <= refusals <= elapsed + 2 and refusals < 100, (refusals, elapsed)
