"""Bad input over the wire: each gets a status naming the field; everyone else carries on."""

from __future__ import annotations

import pytest

from afd_ctl.client import ControllerClient
from afd_ctl.errors import AfdRejected, AfdStaleEpoch, AfdTimeout
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload
from tests.procs import sim_worker

GOOD_STEPS = 40


def bad_payloads(step: int):
    """(name, payload, expected code, text naming the field) for a 2-rank attention DP."""

    def base():
        return make_payload(step, 2, 1)

    p = base()
    p.stages[0].num_tokens_across_dp.append(1)
    yield "dp list too long", p, "INVALID_ARGUMENT", "stages[0].num_tokens_across_dp has 3 entries"
    p = base()
    p.stages[0].num_tokens_across_dp[1] = -4
    yield "negative count", p, "INVALID_ARGUMENT", "num_tokens_across_dp[1] is -4"
    p = base()
    p.stages[0].max_tokens_across_dp += 1
    yield "wrong max", p, "INVALID_ARGUMENT", "stages[0].max_tokens_across_dp"
    p = make_payload(step, 2, 2)
    p.stages[2].CopyFrom(p.stages[1])
    yield "three stages", p, "INVALID_ARGUMENT", "stages has 3 entries"
    yield "step backwards", make_payload(1, 2, 1), "INVALID_ARGUMENT", "step_id 1 does not increase"


def test_bad_payloads_are_refused_and_the_ffn_worker_carries_on(start_daemon, procs, tmp_path):
    daemon = start_daemon("--expect-attention", "2")
    ffn = sim_worker(
        tmp_path / "ffn.log",
        daemon.address,
        "ffn",
        "--attention-dp-size",
        "2",
        "--steps",
        str(GOOD_STEPS),
        "--timeout",
        "30",
    )
    procs.append(ffn)
    sender = ControllerClient(daemon.address, WorkerSpec("attn-0", ATTENTION, dp_size=2))
    other = ControllerClient(daemon.address, WorkerSpec("attn-1", ATTENTION, dp_rank=1, dp_size=2))
    try:
        sender.connect(10)
        other.connect(10)
        sender.wait_complete(10)
        assert sender.is_sender and not other.is_sender
        step = 1
        cases = list(bad_payloads(0))
        for name, _, code, text in cases:
            for _ in range(5):
                sender.publish(make_payload(step, 2, 1))
                step += 1
            bad = next(b for n, b, _, _ in bad_payloads(step) if n == name)
            sender.publish(bad)
            with pytest.raises(AfdRejected) as err:
                sender.flush()
            assert err.value.code == code and text in err.value.message, name

        stale = make_payload(step, 2, 1)
        sender.publish(stale, stamp=False)  # epoch left at 0
        with pytest.raises(AfdStaleEpoch, match="FAILED_PRECONDITION: epoch 0 is stale"):
            sender.flush()

        other.publish(make_payload(step, 2, 1))
        with pytest.raises(
            AfdRejected, match="PERMISSION_DENIED: attention rank 1 .* not a designated sender"
        ):
            other.flush()

        while step <= GOOD_STEPS:
            sender.publish(make_payload(step, 2, 1))
            step += 1
        report = ffn.json_report(30)
        assert report["problems"] == [] and report["received"] == GOOD_STEPS
        assert (report["first_step"], report["last_step"]) == (1, GOOD_STEPS)
    finally:
        sender.close()
        other.close()


def test_bad_registrations_are_refused_with_the_field_named(start_daemon):
    daemon = start_daemon("--expect-ffn", "2", "--max-blob-bytes", "4096")

    def register(spec: WorkerSpec, timeout: float = 5) -> ControllerClient:
        client = ControllerClient(daemon.address, spec)
        try:
            client.connect(timeout)
        except Exception:
            client.close()
            raise
        return client

    with pytest.raises(AfdRejected, match="INVALID_ARGUMENT: data_plane_blob is 4097 bytes"):
        register(WorkerSpec("f", FFN, dp_size=2, data_plane_blob=b"x" * 4097))
    with pytest.raises(
        AfdRejected, match="dp_size\\*tp_size = 1\\*1 does not match .*--expect-ffn 2"
    ):
        register(WorkerSpec("f", FFN))
    with pytest.raises(AfdRejected, match="dp_rank 2 must be below dp_size 2"):
        register(WorkerSpec("f", FFN, dp_rank=2, dp_size=2))
    with pytest.raises(AfdRejected, match="worker_id is empty"):
        register(WorkerSpec("", FFN, dp_size=2))
    first = register(WorkerSpec("ffn-0", FFN, dp_size=2))
    try:
        with pytest.raises(AfdTimeout, match="ALREADY_EXISTS.*held by worker_id 'ffn-0'"):
            register(WorkerSpec("ffn-0-twin", FFN, dp_size=2), timeout=1.5)
        assert first.view.expected_ffn == 2  # the holder is untouched
        assert first.registered.worker.worker_id == "ffn-0"
    finally:
        first.close()
