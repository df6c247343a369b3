"""An operator's view: the real grpcurl binary against a live daemon."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from afd_ctl.client import ControllerClient
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (make setup)")


def grpcurl(
    address: str, *verb: str, flags: tuple[str, ...] = (), timeout: float = 15
) -> subprocess.CompletedProcess[str]:
    """`grpcurl -plaintext FLAGS ADDRESS VERB...`"""
    return subprocess.run(
        [GRPCURL, "-plaintext", *flags, address, *verb],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Lines:
    """The lines a child process writes, read by a thread so a test can wait for one."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, text: str, timeout: float) -> None:
        while not any(text in line for line in self.seen):
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"{text!r} not seen in {timeout} s: {self.seen}") from None
            assert line is not None, f"output ended before {text!r}: {self.seen}"
            self.seen.append(line)

    def rest(self, timeout: float) -> str:
        """Everything, once the stream ends."""
        while (line := self._lines.get(timeout=timeout)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


def health(address: str) -> str:
    out = grpcurl(address, "grpc.health.v1.Health/Check", flags=("-d", '{"service": ""}'))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["status"]


def test_grpcurl_lists_describes_checks_health_reads_status_and_taps(start_daemon):
    daemon = start_daemon()
    address = daemon.address

    listed = grpcurl(address, "list")
    assert listed.returncode == 0, listed.stderr
    for service in ("afd.v1.AFDController", "afd.v1.AFDInspect", "grpc.health.v1.Health"):
        assert service in listed.stdout.split()

    described = grpcurl(address, "describe", "afd.v1.AFDControlPayload")
    assert described.returncode == 0, described.stderr
    for field in (
        "step_id",
        "epoch",
        "is_graph_replaying",
        "map<uint32, .afd.v1.DPMetadata> stages",
    ):
        assert field in described.stdout

    assert health(address) == "NOT_SERVING"
    attn = ControllerClient(address, WorkerSpec("attn-0", ATTENTION))
    ffn = ControllerClient(address, WorkerSpec("ffn-0", FFN))
    try:
        attn.connect(10)
        ffn.connect(10)
        attn.wait_complete(10)
        assert health(address) == "SERVING"

        tap = subprocess.Popen(
            [
                GRPCURL,
                "-plaintext",
                "-v",
                "-max-time",
                "20",
                "-d",
                '{"include_payloads": true}',
                address,
                "afd.v1.AFDInspect/Tap",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            # The daemon sends the response headers once the tap is subscribed.
            tapped = Lines(tap.stdout)  # type: ignore[arg-type]
            tapped.wait_for("Response headers received", timeout=15)
            for step in range(1, 6):
                attn.publish(make_payload(step, 1, 1))
            assert [ffn.next_payload(5).step_id for _ in range(5)] == [1, 2, 3, 4, 5]
            tapped.wait_for('"step_id": "5"', timeout=15)
            assert "num_tokens_across_dp" in "".join(tapped.seen)
        finally:
            tap.kill()
            tap.wait(10)

        status = grpcurl(address, "afd.v1.AFDInspect/GetStatus")
        assert status.returncode == 0, status.stderr
        parsed = json.loads(status.stdout)
        assert parsed["health"] == "SERVING" and parsed["steps_relayed"] == "5"
        assert {r["role"]: r["registered"] for r in parsed["roles"]} == {"ATTENTION": 1, "FFN": 1}

        # A malformed request gets a status that names the field, and nothing changes.
        bad = grpcurl(address, "afd.v1.AFDInspect/ListWorkers", flags=("-d", '{"role": 7}'))
        assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "role 7" in bad.stderr
        # Publishing as attn-0 from another connection (issue 10, bug 3) is refused.
        payload = '{"step_id": 9, "epoch": 1, "stages": {"0": {"num_tokens_across_dp": [3, 4]}}}'
        bad_payload = grpcurl(
            address,
            "afd.v1.AFDController/Publish",
            flags=("-H", "afd-worker-id: attn-0", "-d", payload),
        )
        assert "PermissionDenied" in bad_payload.stderr, bad_payload
        assert "'afd-publish-secret' is missing" in bad_payload.stderr, bad_payload
        assert health(address) == "SERVING"
        attn.publish(make_payload(6, 1, 1))
        assert ffn.next_payload(5).step_id == 6
    finally:
        attn.close()
        ffn.close()


def test_prometheus_metrics(start_daemon):
    import urllib.request

    daemon = start_daemon("--metrics-port", "-1")  # a free port, named in the log
    port = int(daemon.wait_for(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", 10).group(1))
    client = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN))
    try:
        client.connect(10)
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
    finally:
        client.close()
    assert 'afd_ctl_workers_registered{role="ffn"} 1.0' in text
    assert 'afd_ctl_workers_expected{role="attention"} 1.0' in text
    assert "afd_ctl_serving 0.0" in text and "afd_ctl_epoch " in text


def test_grpcurl_health_check_on_a_token_daemon(start_daemon):
    """The README's health example on a daemon with a token: grpcurl needs the header (its
    reflection lookup is not exempt); the health check itself is (probes call it bare)."""
    daemon = start_daemon("--auth-token", "tok3n")
    check = ("grpc.health.v1.Health/Check",)
    bare = grpcurl(daemon.address, *check, flags=("-d", '{"service": ""}'))
    assert bare.returncode != 0 and "authorization metadata is missing" in bare.stderr, bare
    header = ("-H", "authorization: Bearer tok3n", "-d", '{"service": ""}')
    with_token = grpcurl(daemon.address, *check, flags=header)
    assert with_token.returncode == 0, with_token.stderr
    assert json.loads(with_token.stdout)["status"] == "NOT_SERVING"

    with grpc.insecure_channel(daemon.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
