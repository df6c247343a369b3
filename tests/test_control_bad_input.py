"""Bad input over the wire: each gets a status naming the field; everyone else carries on."""

from __future__ import annotations

import grpc
import pytest

from afd_ctl.client import ControllerClient
from afd_ctl.errors import AfdRejected, AfdStaleEpoch, AfdTimeout
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from tests.procs import sim_worker

GOOD_STEPS = 60


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
    p = base()
    p.records_only = True
    yield "records_only alone", p, "INVALID_ARGUMENT", "records_only is set without is_graph"
    # Issue 39: contradictory flags relayed as they came, and a step id at the 64-bit limit
    # that overflowed the next trace's start step.
    p = base()
    p.is_graph_capturing = p.is_graph_replaying = True
    yield "capture and replay", p, "INVALID_ARGUMENT", "is_graph_capturing and is_graph_replaying"
    p = base()
    p.is_graph_capturing = p.records_only = p.is_profile = True
    yield "records_only profile", p, "INVALID_ARGUMENT", "records_only is set with is_profile"
    p = base()
    p.step_id = (1 << 64) - 1
    yield "step id at 2^64-1", p, "INVALID_ARGUMENT", "step_id 18446744073709551615 is above 2^62"
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


IDENTITY = {"request_serializer": None, "response_deserializer": None}


def raw_error(call: object) -> grpc.RpcError:
    """The error a raw call (bytes in, bytes out) ends with."""
    with pytest.raises(grpc.RpcError) as err:
        if isinstance(call, grpc.Call) and hasattr(call, "__iter__"):
            list(call)  # type: ignore[call-overload]
        else:
            call()  # type: ignore[operator]
    return err.value


def test_malformed_bytes_on_every_rpc_are_invalid_argument_naming_the_message(start_daemon):
    """Issue 10, bug 5: bytes that are not the method's message, on every RPC the daemon serves
    (health and reflection included), get INVALID_ARGUMENT, one log line, no traceback, and
    change nothing (not even a malformed Stop)."""
    daemon = start_daemon()
    attn = ControllerClient(daemon.address, WorkerSpec("attn-0", ATTENTION))
    garbage = b"\xff\xff\xff"  # a field key that never ends
    # SessionRequest{register{worker_id: <not UTF-8>}}, to see the field named.
    bad_utf8 = b"\x0a\x04\x32\x02\xff\xfe"
    try:
        attn.connect(10)
        secret = (
            ("afd-worker-id", "attn-0"),
            ("afd-publish-secret", attn.registered.publish_secret),
        )
        with grpc.insecure_channel(daemon.address) as channel:
            unary = {
                "/afd.v1.AFDInspect/GetStatus": "afd.v1.GetStatusRequest",
                "/afd.v1.AFDInspect/ListWorkers": "afd.v1.ListWorkersRequest",
                "/afd.v1.AFDInspect/Stop": "afd.v1.StopRequest",
                "/grpc.health.v1.Health/Check": "grpc.health.v1.HealthCheckRequest",
            }
            for method, message in unary.items():
                call = channel.unary_unary(method, **IDENTITY)
                error = raw_error(lambda call=call: call(garbage, timeout=10))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
                assert f"not a valid {message} at byte 0: truncated field key" in error.details()
            for method, message in {
                "/afd.v1.AFDInspect/Tap": "afd.v1.TapRequest",
                "/grpc.health.v1.Health/Watch": "grpc.health.v1.HealthCheckRequest",
            }.items():
                call = channel.unary_stream(method, **IDENTITY)(garbage, timeout=10)
                error = raw_error(call)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
                assert f"not a valid {message}" in error.details()
            streams = [
                ("/afd.v1.AFDController/Session", (), bad_utf8, "register.worker_id: not valid"),
                ("/afd.v1.AFDController/Session", (), garbage, "afd.v1.SessionRequest"),
                ("/afd.v1.AFDController/Publish", secret, garbage, "afd.v1.AFDControlPayload"),
                (
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                    (),
                    garbage,
                    "grpc.reflection.v1alpha.ServerReflectionRequest",
                ),
            ]
            # After a good registration, too (the daemon reads those in a task of its own).
            register = afd_pb2.RegisterRequest(
                role=afd_pb2.FFN, worker_id="f", dp_size=1, tp_size=1
            )
            first = afd_pb2.SessionRequest(register=register).SerializeToString()
            streams.append(
                ("/afd.v1.AFDController/Session", (), [first, garbage], "SessionRequest")
            )
            for method, metadata, data, text in streams:
                stream = channel.stream_stream(method, **IDENTITY)
                messages = data if isinstance(data, list) else [data]
                error = raw_error(stream(iter(messages), metadata=metadata, timeout=10))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
                assert text in error.details(), (method, error.details())
            status = afd_pb2_grpc.AFDInspectStub(channel).GetStatus(afd_pb2.GetStatusRequest())
        assert status.health_state == afd_pb2.NOT_SERVING  # not DRAINING: Stop was refused
        assert attn.registered.worker.worker_id == "attn-0"
    finally:
        attn.close()
    log = daemon.log()
    assert "malformed request refused" in log and "malformed Session message" in log
    assert "Traceback" not in log and "Unexpected" not in log, log


def test_unknown_role_and_huge_ids_are_refused_without_flooding_the_log(start_daemon):
    """Issue 10, bugs 5 and 6: role 7 is INVALID_ARGUMENT naming the field; a 1 MiB worker id
    and a 7,000-character afd-worker-id are refused, and neither is echoed or logged whole."""
    daemon = start_daemon()
    with grpc.insecure_channel(daemon.address) as channel:
        stub = afd_pb2_grpc.AFDControllerStub(channel)
        for register, why in (
            (
                afd_pb2.RegisterRequest(role=7, worker_id="w"),
                "role must be ATTENTION or FFN, got 7",
            ),
            (
                afd_pb2.RegisterRequest(role=afd_pb2.FFN, worker_id="x" * (1 << 20)),
                "worker_id is longer than 256 characters",
            ),
        ):
            for _ in range(3):
                call = stub.Session(iter([afd_pb2.SessionRequest(register=register)]), timeout=10)
                error = raw_error(call)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
                assert why in error.details() and len(error.details()) < 1000
        payload = make_payload(1, 1, 1)
        call = stub.Publish(iter([payload]), metadata=(("afd-worker-id", "y" * 7000),), timeout=10)
        error = raw_error(call)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
        assert "...(7000 chars)" in error.details() and len(error.details()) < 1000
    log = daemon.log()
    assert "Traceback" not in log
    assert max(len(line) for line in log.splitlines()) < 1000
    # Refused registrations are logged at most once a second (with a count of those not shown).
    assert 1 <= log.count("registration refused") < 6


def test_a_worker_of_another_model_is_refused_at_connect(start_daemon):
    """Issue 22, item 8, over the wire: connect() of an FFN worker serving another model than
    the registered attention worker ends at once with FAILED_PRECONDITION naming both sides'
    values; the attention worker carries on, and the right model then joins."""
    import time

    from afd_ctl.fingerprint import ModelFingerprint

    v3 = ModelFingerprint("DeepseekV3ForCausalLM", 61, 7168, 256, 1, "bfloat16")
    v2 = ModelFingerprint("DeepseekV2ForCausalLM", 27, 2048, 64, 2, "bfloat16")
    daemon = start_daemon()
    attn = ControllerClient(daemon.address, WorkerSpec("attn-0", ATTENTION, model=v3))
    attn.connect(10)
    wrong = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN, model=v2))
    start = time.monotonic()
    try:
        with pytest.raises(AfdRejected, match="FAILED_PRECONDITION: model mismatch") as err:
            wrong.connect(60)
        assert time.monotonic() - start < 10
        assert "num_layers 27 vs 61" in str(err.value) and "hidden_size 2048 vs 7168" in str(
            err.value
        )
    finally:
        wrong.close()
    right = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN, model=v3))
    try:
        right.connect(10)
        assert attn.wait_complete(10).complete
    finally:
        right.close()
        attn.close()
    assert "model mismatch" in daemon.log()
