"""An operator's view: the real grpcurl binary against a live daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
                "-max-time",
                "4",
                "-d",
                '{"include_payloads": true}',
                address,
                "afd.v1.AFDInspect/Tap",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.5)  # let grpcurl resolve the method through reflection and subscribe
        for step in range(1, 6):
            attn.publish(make_payload(step, 1, 1))
        assert [ffn.next_payload(5).step_id for _ in range(5)] == [1, 2, 3, 4, 5]
        tapped, _ = tap.communicate(timeout=15)
        assert '"step_id": "5"' in tapped and "num_tokens_across_dp" in tapped

        status = grpcurl(address, "afd.v1.AFDInspect/GetStatus")
        assert status.returncode == 0, status.stderr
        parsed = json.loads(status.stdout)
        assert parsed["health"] == "SERVING" and parsed["steps_relayed"] == "5"
        assert {r["role"]: r["registered"] for r in parsed["roles"]} == {"ATTENTION": 1, "FFN": 1}

        # A malformed request gets a status that names the field, and nothing changes.
        bad = grpcurl(address, "afd.v1.AFDInspect/ListWorkers", flags=("-d", '{"role": 7}'))
        assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "role 7" in bad.stderr
        payload = '{"step_id": 9, "epoch": 1, "stages": {"0": {"num_tokens_across_dp": [3, 4]}}}'
        bad_payload = grpcurl(
            address,
            "afd.v1.AFDController/Publish",
            flags=("-H", "afd-worker-id: attn-0", "-d", payload),
        )
        assert "epoch 1 is stale" in bad_payload.stdout, bad_payload
        assert health(address) == "SERVING"
        attn.publish(make_payload(6, 1, 1))
        assert ffn.next_payload(5).step_id == 6
    finally:
        attn.close()
        ffn.close()


def test_prometheus_metrics(start_daemon):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start_daemon("--metrics-port", str(port))
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
