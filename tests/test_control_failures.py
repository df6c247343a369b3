"""Failures a cluster sees: a worker killed or frozen, the daemon stopped, killed, restarted.

The daemon and the victim workers are separate processes; the surviving workers are real
clients in this test process (threads), so the test can time what they are told.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

from afd_ctl.client import ControllerClient
from afd_ctl.errors import AfdControllerUnreachable, AfdPeerLost, AfdStaleEpoch, AfdStopped
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from tests.procs import Daemon, Proc, sim_worker

LIVENESS_S = 2.0
SLACK_S = 1.0  # process scheduling on a loaded 2-core machine

Kind = afd_pb2.MembershipEvent.Kind
SERVING = HealthCheckResponse.SERVING


class Watcher:
    """Records when membership events reach a client."""

    def __init__(self, client: ControllerClient) -> None:
        self.events: list[tuple[float, afd_pb2.MembershipEvent]] = []
        self._cond = threading.Condition()
        client.add_listener(self._on_event)

    def _on_event(self, event: afd_pb2.MembershipEvent) -> None:
        with self._cond:
            self.events.append((time.monotonic(), event))
            self._cond.notify_all()

    def wait(
        self, kind: int, timeout: float, after: float = 0.0
    ) -> tuple[float, afd_pb2.MembershipEvent]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for when, event in self.events:
                    if event.kind == kind and when >= after:
                        return when, event
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no {Kind.Name(kind)} within {timeout} s: {self.events}"
                self._cond.wait(remaining)


def client(daemon: Daemon, worker_id: str, role: str, **spec: int) -> ControllerClient:
    c = ControllerClient(daemon.address, WorkerSpec(worker_id, role, **spec))
    c.connect(timeout_s=10)
    return c


def publish_steps(c: ControllerClient, first: int, count: int) -> None:
    for step in range(first, first + count):
        c.publish(make_payload(step, 1, 1))


def test_killed_ffn_worker_is_reported_within_the_bound_and_replaced(start_daemon, procs, tmp_path):
    daemon = start_daemon("--expect-ffn", "2", "--liveness-timeout-s", str(LIVENESS_S))
    victim = sim_worker(
        tmp_path / "victim.log",
        daemon.address,
        "ffn",
        "--dp-rank",
        "1",
        "--dp-size",
        "2",
        "--worker-id",
        "ffn-1",
        "--steps",
        "0",
        "--timeout",
        "60",
    )
    procs.append(victim)
    attn = client(daemon, "attn-0", ATTENTION)
    ffn0 = client(daemon, "ffn-0", FFN, dp_rank=0, dp_size=2)
    watchers = {"attention": Watcher(attn), "ffn-0": Watcher(ffn0)}
    try:
        first_epoch = attn.wait_complete(10).epoch
        publish_steps(attn, 1, 50)
        assert [ffn0.next_payload(5).step_id for _ in range(50)] == list(range(1, 51))

        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        for name, watcher in watchers.items():
            when, event = watcher.wait(Kind.PEER_LOST, LIVENESS_S + SLACK_S)
            assert when - killed_at <= LIVENESS_S + SLACK_S, name
            assert event.worker.worker_id == "ffn-1" and not event.view.complete
            assert event.view.epoch > first_epoch
        # Nothing hangs: both sides get a typed error at once.
        with pytest.raises(AfdPeerLost, match="afd peer lost: ffn rank 1"):
            ffn0.next_payload(30)
        with pytest.raises(AfdPeerLost, match="ffn-1"):
            attn.publish(make_payload(51, 1, 1))

        replacement = sim_worker(
            tmp_path / "replacement.log",
            daemon.address,
            "ffn",
            "--dp-rank",
            "1",
            "--dp-size",
            "2",
            "--worker-id",
            "ffn-1",
            "--steps",
            "10",
        )
        procs.append(replacement)
        view = attn.wait_complete(20)
        assert view.epoch > first_epoch + 1
        assert ffn0.wait_complete(5).epoch == view.epoch
        publish_steps(attn, 51, 10)
        assert [ffn0.next_payload(5).step_id for _ in range(10)] == list(range(51, 61))
        report = replacement.json_report(20)
        assert (report["received"], report["first_step"], report["problems"]) == (10, 51, [])
    finally:
        attn.close()
        ffn0.close()


def test_frozen_worker_is_declared_lost_by_keepalive(start_daemon, procs, tmp_path):
    daemon = start_daemon("--liveness-timeout-s", str(LIVENESS_S))
    victim = sim_worker(
        tmp_path / "victim.log", daemon.address, "ffn", "--steps", "0", "--timeout", "60"
    )
    procs.append(victim)
    attn = client(daemon, "attn-0", ATTENTION)
    watcher = Watcher(attn)
    try:
        attn.wait_complete(10)
        frozen_at = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        when, event = watcher.wait(Kind.PEER_LOST, LIVENESS_S + SLACK_S + 1)
        assert when - frozen_at <= LIVENESS_S + SLACK_S
        assert event.worker.role == afd_pb2.FFN
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        attn.close()


# A worker whose Python is busy: the GIL is held for BUSY_S in one stretch (a long switch
# interval lets no other thread run, as a long C call or a starved 2-core machine does while
# torch.compile runs), so it sends no heartbeat and reads nothing meanwhile.
BUSY_WORKER = """
import sys, time
from afd_ctl.client import ControllerClient
from afd_ctl.membership import FFN, WorkerSpec
client = ControllerClient(sys.argv[1], WorkerSpec("ffn-busy", FFN))
epoch = client.connect(10).view.epoch
print("registered", flush=True)
sys.setswitchinterval(60)
start = time.monotonic()
while time.monotonic() - start < float(sys.argv[2]):
    pass
sys.setswitchinterval(0.005)
time.sleep(1)
print("still registered" if client.registered.view.epoch == epoch else "registered again",
      client._view.unreachable, flush=True)
client.close()
"""


def test_a_worker_whose_python_is_busy_is_not_lost(start_daemon, procs, tmp_path):
    """Issue 22, item 7: a worker compiling with the GIL held for 3x the liveness bound sends
    no heartbeat, but grpc's C core answers the keepalive pings: the daemon keeps it (no
    PEER_LOST, the set stays complete) and its own session does not hang up. A frozen one
    (SIGSTOP) is still lost within the bound (the test above)."""
    daemon = start_daemon("--liveness-timeout-s", str(LIVENESS_S))
    attn = client(daemon, "attn-0", ATTENTION)
    watcher = Watcher(attn)
    busy = Proc(
        [sys.executable, "-c", BUSY_WORKER, daemon.address, str(3 * LIVENESS_S)],
        tmp_path / "busy.log",
    )
    procs.append(busy)
    try:
        busy.wait_for("registered", 20)
        attn.wait_complete(10)
        busy.wait_for(r"still registered None|registered again", 30)
        assert "still registered None" in busy.log(), busy.log()
        assert busy.wait(10) == 0
        lost = [e for _, e in watcher.events if e.kind == Kind.PEER_LOST]
        assert len(lost) == 1 and "session closed" in lost[0].reason, lost  # its close only
        assert "no heartbeat" not in daemon.log()
    finally:
        attn.close()


def test_sigterm_is_a_restart_every_worker_rides_out_and_stop_shuts_down(
    start_daemon, procs, tmp_path
):
    """Issue 22, item 1. SIGTERM drains the daemon as a restart: health NOT_SERVING, every
    worker told DAEMON_DRAINING and hung up, the daemon exits 0 at once; no worker exits, and
    both roles register again with the next daemon on the same address, in a complete set.
    `afd-ctl stop` then shuts the deployment down: the FFN workers exit 0, the attention
    worker is out of service but not stopped for good (it registers with a later daemon)."""
    daemon = start_daemon("--expect-ffn", "2", "--drain-grace-s", "3")
    ffn = [
        sim_worker(
            tmp_path / f"ffn{f}.log",
            daemon.address,
            "ffn",
            "--dp-rank",
            str(f),
            "--dp-size",
            "2",
            "--steps",
            "0",
            "--timeout",
            "60",
        )
        for f in range(2)
    ]
    procs.extend(ffn)
    attn = client(daemon, "attn-0", ATTENTION)
    channel = grpc.insecure_channel(daemon.address)
    watch = HealthStub(channel).Watch(
        HealthCheckRequest(service="afd.v1.AFDController"), timeout=60
    )
    try:
        first = attn.wait_complete(10)
        statuses = [next(watch).status]
        while statuses[-1] != SERVING:
            statuses.append(next(watch).status)
        publish_steps(attn, 1, 20)
        attn.flush()
        daemon.signal(signal.SIGTERM)
        daemon.signal(signal.SIGTERM)  # idempotent
        # Health goes NOT_SERVING on drain (and nothing turns it back) before the daemon goes.
        assert next(watch).status == HealthCheckResponse.NOT_SERVING
        assert attn.wait_drained(5)
        assert daemon.wait(5) == 0  # everyone hung up at once: no drain grace spent
        log = daemon.log()
        assert "draining: SIGTERM received" in log and "drain grace" not in log
        assert all(proc.popen.poll() is None for proc in ffn)  # nobody exited

        again = start_daemon("--expect-ffn", "2", listen=daemon.address)
        view = attn.wait_complete(20, after_epoch=first.epoch)
        assert view.controller_incarnation != first.controller_incarnation
        for rank in range(2):
            again.wait_for(rf"worker registered: ffn rank {rank}", 10)

        from afd_ctl.cli import main

        assert main(["stop", "--controller", again.address, "--reason", "maintenance"]) == 0
        for proc in ffn:
            report = proc.json_report(10)
            assert report["received"] == 20 and "maintenance" in report["stopped"], report
            assert not report["problems"], report
            assert proc.wait(5) == 0
        assert again.wait(10) == 0
        # The attention worker was not stopped for good: a later daemon sees it again.
        third = start_daemon("--expect-ffn", "2", listen=daemon.address)
        third.wait_for("worker registered: attention rank 0", 10)
    finally:
        channel.close()
        attn.close()


def test_daemon_killed_and_restarted_clients_reconnect_under_a_new_epoch(start_daemon, tmp_path):
    daemon = start_daemon("--liveness-timeout-s", str(LIVENESS_S))
    attn = client(daemon, "attn-0", ATTENTION)
    ffn = client(daemon, "ffn-0", FFN)
    try:
        old = attn.wait_complete(10)
        publish_steps(attn, 1, 5)
        assert [ffn.next_payload(5).step_id for _ in range(5)] == [1, 2, 3, 4, 5]

        daemon.signal(signal.SIGKILL)
        daemon.wait(5)
        killed_at = time.monotonic()
        with pytest.raises(AfdControllerUnreachable, match="unreachable"):
            ffn.next_payload(LIVENESS_S + SLACK_S)
        assert time.monotonic() - killed_at <= LIVENESS_S + SLACK_S
        # The attention client shares the dead connection; its threads notice within moments
        # (publish only queues, so it reports what the client already knows).
        deadline = time.monotonic() + SLACK_S
        while True:
            try:
                attn.publish(make_payload(6, 1, 1))
            except AfdControllerUnreachable:
                break
            assert time.monotonic() < deadline, "publish accepted 1 s after the daemon died"
            time.sleep(0.01)
        with pytest.raises(AfdControllerUnreachable):  # still down: fails at once, no hang
            ffn.next_payload(30)

        start_daemon("--liveness-timeout-s", str(LIVENESS_S), listen=daemon.address)
        new = attn.wait_complete(20)
        assert new.epoch > old.epoch
        assert new.controller_incarnation != old.controller_incarnation
        ffn.wait_complete(10)
        publish_steps(attn, 1, 5)  # a new daemon: step ids start again
        assert [ffn.next_payload(5).step_id for _ in range(5)] == [1, 2, 3, 4, 5]
    finally:
        attn.close()
        ffn.close()


def test_stop_from_the_cli_reaches_workers(start_daemon, tmp_path):
    daemon = start_daemon()
    ffn = client(daemon, "ffn-0", FFN)
    attn = client(daemon, "attn-0", ATTENTION)
    try:
        ffn.wait_complete(10)
        from afd_ctl.cli import main

        assert main(["stop", "--controller", daemon.address, "--reason", "maintenance"]) == 0
        with pytest.raises(AfdStopped, match="maintenance"):
            ffn.next_payload(5)
        # The attention worker is out of service, not stopped: it says why and retries.
        assert attn.wait_drained(5)
        with pytest.raises(AfdControllerUnreachable, match="sent stop \\(maintenance\\)"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                attn.publish(make_payload(1, 1, 1))
                time.sleep(0.01)
        assert daemon.wait(10) == 0
    finally:
        ffn.close()
        attn.close()


def test_a_worker_that_leaves_with_a_reason_tells_its_peers(start_daemon):
    """A failing worker closes with its error: every peer's PEER_LOST event carries it at once
    (not a bare "session closed"), and so does the daemon's log."""
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    attention = client(daemon, "att-0", ATTENTION)
    ffn = client(daemon, "ffn-0", FFN)
    try:
        watcher = Watcher(attention)
        attention.wait_complete(10)
        start = time.monotonic()
        ffn.close(reason="RuntimeError: expert weights missing for layer 3")
        when, event = watcher.wait(Kind.PEER_LOST, timeout=5)
        assert when - start < 2.0
        assert event.worker.worker_id == "ffn-0"
        assert event.reason == "left: RuntimeError: expert weights missing for layer 3"
        daemon.wait_for("expert weights missing", 5)
        # Afterwards too: `afd-ctl status` lists the loss and its reason.
        out = subprocess.run(
            [sys.executable, "-m", "afd_ctl.cli", "status", "--controller", daemon.address],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        lost = [line for line in out.stdout.splitlines() if "PEER_LOST" in line]
        assert lost and "ffn 0 (ffn-0): left: RuntimeError: expert weights" in lost[-1], out.stdout
    finally:
        attention.close()
        ffn.close()


def test_rejoin_moves_every_peer_to_a_new_epoch(start_daemon):
    """A worker stuck on its data plane while afd-ctl sees everyone alive rejoins: its peers
    get PEER_LOST saying why, then a complete view in a newer epoch, and so does it."""
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    attention = client(daemon, "att-0", ATTENTION)
    ffn = client(daemon, "ffn-0", FFN)
    try:
        watcher = Watcher(attention)
        old = attention.wait_complete(10)
        ffn.wait_complete(10)
        ffn.rejoin("hidden states of step 7 not received within 10 s")
        _, event = watcher.wait(Kind.PEER_LOST, timeout=5)
        assert event.reason == "left: rejoining: hidden states of step 7 not received within 10 s"
        new = attention.wait_complete(10, after_epoch=old.epoch)
        assert ffn.wait_complete(10, after_epoch=old.epoch).epoch == new.epoch > old.epoch
        assert ffn.role_rank == 0
    finally:
        attention.close()
        ffn.close()


# A test client that stops reading: its stream receive window is 1 KiB and stays so (no BDP
# growth). The daemon's write to it blocks after about 40 tiny payloads instead of the ~2,400
# that fill gRPC's default 64 KiB, so a cut-off needs a few dozen relayed steps, not thousands
# pushed through a loaded machine.
WINDOW_BYTES = 1024
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", WINDOW_BYTES)]
# Steps published at a client that stops reading: many times what fits in its window plus
# its --subscriber-queue of 8, so the daemon must cut it off long before the last one.
FLOOD_STEPS = 1000


def read_to_the_end(call: Iterator[object], bound: int) -> tuple[int, grpc.RpcError | None]:
    """Reads what was in flight; (messages read, the error the stream ended with)."""
    count = 0
    try:
        for _ in call:
            count += 1
            assert count <= bound, f"more than {bound} messages after the cut-off"
    except grpc.RpcError as error:
        return count, error
    return count, None


def test_a_tap_that_stops_reading_is_cut_off_and_told(start_daemon):
    """Issue 10, bug 7: a tap that does not read is cut off once --subscriber-queue events
    wait for it, and its stream ends with RESOURCE_EXHAUSTED saying why, right after what was
    already in flight; the workers are unaffected."""
    daemon = start_daemon("--subscriber-queue", "8")
    attn = client(daemon, "attn-0", ATTENTION)
    ffn = client(daemon, "ffn-0", FFN)
    with grpc.insecure_channel(daemon.address, options=SMALL_WINDOW) as channel:
        tap = afd_pb2_grpc.AFDInspectStub(channel).Tap(
            afd_pb2.TapRequest(include_payloads=True), timeout=60
        )
        try:
            tap.initial_metadata()  # subscribed
            attn.wait_complete(10)
            step = 0
            deadline = time.monotonic() + 30
            while "cut off: tap fell behind" not in daemon.log():
                assert time.monotonic() < deadline, "the tap was not cut off"
                for _ in range(4):  # in small batches the FFN worker keeps up with
                    step += 1
                    attn.publish(make_payload(step, 1, 1))
                assert ffn.next_payload(5).step_id == step - 3
                for expected in range(step - 2, step + 1):
                    assert ffn.next_payload(5).step_id == expected
            read, error = read_to_the_end(tap, bound=step)
            assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tap fell behind: 8 events queued and unread" in error.details()
            assert read < step  # what was in flight, not everything since
            # The workers carry on.
            attn.publish(make_payload(step + 1, 1, 1))
            assert ffn.next_payload(5).step_id == step + 1
        finally:
            attn.close()
            ffn.close()


def test_a_session_that_stops_reading_is_cut_off_and_told(start_daemon):
    """Issue 10, bug 7: an FFN session that does not read (but heartbeats) is cut off once
    --subscriber-queue messages wait for it; its peers get PEER_LOST saying why, and its stream
    ends with RESOURCE_EXHAUSTED saying why, right after what was already in flight."""
    daemon = start_daemon("--subscriber-queue", "8", "--liveness-timeout-s", str(LIVENESS_S))
    attn = client(daemon, "attn-0", ATTENTION)
    watcher = Watcher(attn)
    hung_up = threading.Event()

    def requests() -> Iterator[afd_pb2.SessionRequest]:
        register = afd_pb2.RegisterRequest(
            role=afd_pb2.FFN, worker_id="ffn-0", dp_size=1, tp_size=1
        )
        yield afd_pb2.SessionRequest(register=register)
        while not hung_up.wait(LIVENESS_S / 4):
            yield afd_pb2.SessionRequest(heartbeat=afd_pb2.Heartbeat())

    with grpc.insecure_channel(daemon.address, options=SMALL_WINDOW) as channel:
        session = afd_pb2_grpc.AFDControllerStub(channel).Session(requests(), timeout=60)
        try:
            assert next(session).WhichOneof("message") == "registered"
            attn.wait_complete(10)
            # Queued at once (publish does not block); then this thread waits on the event and
            # leaves the CPU to the relay. Those after the cut-off are refused (new epoch); on a
            # busy machine the cut-off can come back before the flood is queued (2 runs in 8).
            for step in range(1, FLOOD_STEPS + 1):
                try:
                    attn.publish(make_payload(step, 1, 1))
                except (AfdPeerLost, AfdStaleEpoch):
                    break
            _, event = watcher.wait(Kind.PEER_LOST, timeout=10)
            assert event.worker.worker_id == "ffn-0"
            assert "fell behind: 8 messages queued and unread" in event.reason
            read, error = read_to_the_end(session, bound=FLOOD_STEPS)
            assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fell behind: 8 messages queued and unread" in error.details()
            assert read < FLOOD_STEPS // 4  # what was in flight, not everything published
        finally:
            hung_up.set()
            attn.close()


def test_a_normal_stop_logs_no_warning(start_daemon):
    """Issue 22, should-fix: after the attention side's stop payload, the workers leaving are
    the plan: the daemon logs them at INFO, not as WARNING "peer lost"."""
    daemon = start_daemon()
    attn = client(daemon, "attn-0", ATTENTION)
    ffn = client(daemon, "ffn-0", FFN)
    try:
        attn.wait_complete(10)
        publish_steps(attn, 1, 3)
        attn.publish(afd_pb2.AFDControlPayload(step_id=4, stop=True))
        attn.flush()
        for _ in range(3):
            ffn.next_payload(5)
        with pytest.raises(AfdStopped):
            ffn.next_payload(5)
    finally:
        ffn.close(reason="stop received")
        attn.close(reason="attention server shutting down")
    daemon.wait_for("peer lost: attention rank 0", 5)
    log = daemon.log()
    assert "INFO afd_ctl.controller: peer lost: ffn rank 0" in log, log
    # (A loaded test machine may hold the daemon's event loop, which it says: not the stop's.)
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert all("event loop was held" in line for line in warnings), log
