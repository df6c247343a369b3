"""What a new user meets first: one clear line for common mistakes, output that reads well and
scripts can parse, and nothing left behind. No vLLM: every test here takes seconds."""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from afd_ctl.cli import format_workers
from afd_ctl.cli import main as cli
from afd_ctl.v1 import afd_pb2
from tests.conftest import ROOT
from tests.procs import child_env, sim_worker
from tests.test_control_security import pki  # noqa: F401  (the throwaway CA fixture)

NOISE = ("Traceback", "Event loop is closed", "never awaited", "RuntimeError")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
    )


def assert_one_clear_line(out: subprocess.CompletedProcess[str], code: int, message: str) -> None:
    ours = [line for line in out.stderr.splitlines() if line.startswith("afd-ctl serve:")]
    assert out.returncode == code, out.stderr
    assert len(ours) == 1 and message in ours[0], out.stderr
    assert not any(noise in out.stderr for noise in NOISE), out.stderr
    assert "listening on" not in out.stderr, out.stderr


def test_serve_on_a_port_in_use_says_so_in_one_line(busy_port: int):
    out = serve("--listen", f"127.0.0.1:{busy_port}")
    assert_one_clear_line(out, 1, f"port {busy_port} is already in use")


def test_serve_on_a_host_that_does_not_resolve_says_so_in_one_line():
    out = serve("--listen", "no-such-host.invalid:50051")
    assert_one_clear_line(out, 1, "host 'no-such-host.invalid' does not resolve")


def test_serve_on_a_unix_socket_in_a_missing_folder_says_so_in_one_line(tmp_path: Path):
    out = serve("--listen", f"unix:{tmp_path}/missing/afd.sock")
    assert_one_clear_line(out, 1, f"folder {tmp_path}/missing does not exist")


def test_serve_with_an_unknown_log_level_says_so_in_one_line():
    out = serve("--listen", "127.0.0.1:0", "--log-level", "LOUD")
    assert_one_clear_line(out, 2, "--log-level 'LOUD' is not a level")


def test_serve_with_the_metrics_port_in_use_names_the_metrics_port(busy_port: int):
    out = serve("--listen", "127.0.0.1:0", "--metrics-port", str(busy_port))
    assert_one_clear_line(out, 1, f"cannot serve metrics on 127.0.0.1:{busy_port} (--metrics-port)")


def test_serve_with_an_expert_parallel_size_that_leaves_a_group_unfed_says_so_in_one_line():
    out = serve("--listen", "127.0.0.1:0", "--expect-ffn", "2", "--expert-parallel-size", "1")
    assert_one_clear_line(
        out, 2, "--expert-parallel-size 1 makes 2 FFN groups but there are only 1 attention ranks"
    )


def test_status_shows_the_ffn_groups_of_the_expert_parallel_size(start_daemon, capsys):
    """2:4 with --expert-parallel-size 4: one group that both attention ranks reach, in the
    human status, the JSON, and what the vLLM extension reads at start-up."""
    from vllm_ext.control import ControlAccess, ExpectedCounts, expected_counts

    daemon = start_daemon(
        "--expect-attention", "2", "--expect-ffn", "4", "--expert-parallel-size", "4"
    )
    assert cli(["status", "--controller", daemon.address]) == 0
    assert "ffn groups  1 (expert-parallel size 4)" in capsys.readouterr().out
    assert cli(["status", "--controller", daemon.address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ffn_groups"] == 1
    assert expected_counts(ControlAccess(daemon.address), 10) == ExpectedCounts(2, 4, 1)
    assert "routing: 1 ffn group(s) (--expert-parallel-size 4)" in daemon.log()


def test_status_json_has_every_field_with_numbers_as_numbers(start_daemon, capsys):
    daemon = start_daemon()
    assert cli(["status", "--controller", daemon.address, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    # uint64 fields as JSON numbers, and zeros and empty lists present.
    assert isinstance(status["epoch"], int) and status["epoch"] > 1_000_000_000_000
    assert status["steps_relayed"] == 0 and status["payloads_rejected"] == 0
    assert status["last_step_id"] == 0 and status["subscribers"] == []
    assert status["health"] == "NOT_SERVING"
    assert {r["role"]: (r["registered"], r["expected"]) for r in status["roles"]} == {
        "ATTENTION": (0, 1),
        "FFN": (0, 1),
    }
    assert status["ffn_groups"] == 1  # the default, min(M, N)


def test_recent_events_carry_the_daemons_view(start_daemon, capsys):
    """Issue 22, should-fix: an event in `status --json` carries the expected counts (they
    read 0 before); its view has no peers (they are per worker)."""
    from afd_ctl.client import ControllerClient
    from afd_ctl.membership import FFN, WorkerSpec

    daemon = start_daemon("--expect-ffn", "2")
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN, dp_size=2))
    try:
        ffn.connect(10)
        assert cli(["status", "--controller", daemon.address, "--json"]) == 0
        event = json.loads(capsys.readouterr().out)["recent_events"][-1]
        assert event["kind"] == "PEER_JOINED"
        view = event["view"]
        assert (view["expected_attention"], view["expected_ffn"]) == (1, 2), view
        assert view["controller_incarnation"] and view["peers"] == []
    finally:
        ffn.close()


def test_workers_columns_line_up():
    workers = [
        afd_pb2.WorkerInfo(role=afd_pb2.ATTENTION, worker_id="a", dp_rank=0, dp_size=1, tp_size=1),
        afd_pb2.WorkerInfo(
            role=afd_pb2.FFN, worker_id="f", role_rank=12, dp_rank=11, dp_size=16, tp_size=8
        ),
    ]
    header, *rows = format_workers(workers).splitlines()
    for title, values in (("DP", ("0/1", "11/16")), ("TP", ("0/1", "0/8"))):
        end = header.index(title) + len(title)  # right-aligned under the title
        for row, value in zip(rows, values, strict=True):
            assert row[end - len(value) : end] == value, (header, row)
    assert rows[0].index(" a ") == rows[1].index(" f ") == header.index("WORKER ID") - 1


def test_client_help_describes_the_command_and_names_the_environment(capsys):
    with pytest.raises(SystemExit):
        cli(["status", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Show the daemon's health, membership epoch" in text
    for variable in ("AFD_CTL_AUTH_TOKEN", "AFD_CTL_TLS_CA", "AFD_CTL_CONTROLLER"):
        assert variable in text


def test_tls_client_certificate_is_used_without_tls_ca(start_daemon, pki: Path):  # noqa: F811
    """mTLS with the daemon's CA among the system's CAs (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
    stands in for the system store): --tls-cert/--tls-key alone must get through."""
    daemon = start_daemon(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"),
    )  # fmt: skip
    client = ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    out = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "status", "--controller", daemon.address, *client],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env({"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki / "ca.pem")}),
    )
    assert out.returncode == 0 and "NOT_SERVING" in out.stdout, out.stderr
    assert cli(["status", "--controller", daemon.address, "--tls-cert", "x.pem"]) == 2
    missing = ["--tls-cert", "missing.pem", "--tls-key", "missing.key"]
    assert cli(["status", "--controller", daemon.address, *missing]) == 2


def test_watch_says_what_it_watches_before_any_event(start_daemon, procs, tmp_path: Path):
    daemon = start_daemon()
    watch = subprocess.Popen(
        [sys.executable, "-m", "afd_ctl.cli", "watch", "--controller", daemon.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        ready, _, _ = select.select([watch.stderr], [], [], 20)
        assert ready, "afd-ctl watch printed nothing within 20 s"
        first = watch.stderr.readline().strip()
        assert first == f"watching membership events at {daemon.address} until Ctrl-C"
        # And the events themselves come on stdout.
        procs.append(sim_worker(tmp_path / "ffn.log", daemon.address, "ffn", "--hold-s", "30"))
        ready, _, _ = select.select([watch.stdout], [], [], 20)
        assert ready and watch.stdout.readline().startswith("event PEER_JOINED ffn rank 0")
    finally:
        watch.kill()
        watch.wait(10)


def test_watch_with_nothing_listening_says_so_in_one_line_within_its_timeout(capsys):
    """`afd-ctl watch` waits up to --timeout for its connection (a loaded host may need more
    than one try; it once failed at the first), then says in one line that nobody answers."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    assert cli(["watch", "--controller", f"127.0.0.1:{port}", "--timeout", "1"]) == 1
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"afd-ctl watch: no connection to 127.0.0.1:{port} within 1.0 s; is `afd-ctl serve` "
        "running there? (--timeout sets the wait)"
    )


def test_ffn_start_up_says_at_once_that_afd_ctl_does_not_answer():
    """The FFN server's first contact (before any vLLM work): a daemon that is not running is
    reported within seconds while it keeps retrying, not after the whole connect timeout."""
    from vllm_ext.control import ControlAccess, expected_counts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    records: list[tuple[float, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((time.monotonic(), record.getMessage()))

    logger = logging.getLogger("vllm_ext.control")
    handler = Collect(logging.WARNING)
    logger.addHandler(handler)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="is `afd-ctl serve` running there"):
            expected_counts(ControlAccess(address), timeout_s=3)
    finally:
        logger.removeHandler(handler)
    assert records, "nothing said while afd-ctl did not answer"
    at, message = records[0]
    assert at - start < 2.0, message
    assert f"afd-ctl at {address} (plaintext, no bearer token) does not answer" in message
    assert "Retrying" in message


def test_demo_sim_leaves_nothing_in_tmp(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env({"TMPDIR": str(tmp_path)}),
    )
    assert out.returncode == 0 and "demo OK" in out.stdout, out.stdout + out.stderr
    assert "wall-clock milliseconds" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_control_hop_round_leaves_nothing_in_tmp(tmp_path: Path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import control_hop
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    result = control_hop.run_round("floor", steps=20)
    assert result["lost"] == 0 and len(result["latencies_ns"]) == 20
    assert list(tmp_path.iterdir()) == []


def test_demo_answer_reads_as_text():
    """Random weights give pieces of UTF-8 characters; the demo shows them as '?' on one line."""
    from vllm_ext.testing.demo import readable

    assert readable("\ufffd\ufffdT dep\n\ufffdTTT") == "'??T dep??TTT'"


def test_status_lists_live_streams_and_how_far_behind_each_is(start_daemon, capsys):
    """Issue 22, should-fix: `afd-ctl status` shows each Tap client (afd-ctl watch, grpcurl):
    its address, what is queued for it, what it was sent, the last step it got and how many
    steps it is behind the relay."""
    import grpc

    from afd_ctl.client import ControllerClient
    from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
    from afd_ctl.sim_worker import make_payload
    from afd_ctl.v1 import afd_pb2_grpc

    daemon = start_daemon()
    attn = ControllerClient(daemon.address, WorkerSpec("attn-0", ATTENTION))
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN))
    channel = grpc.insecure_channel(daemon.address)
    try:
        attn.connect(10)
        ffn.connect(10)
        attn.wait_complete(10)
        tap = afd_pb2_grpc.AFDInspectStub(channel).Tap(
            afd_pb2.TapRequest(include_payloads=True), timeout=30
        )
        tap.initial_metadata()  # subscribed
        for step in range(1, 6):
            attn.publish(make_payload(step, 1, 1))
        for event in tap:
            if event.HasField("payload") and event.payload.step_id == 5:
                break
        deadline = time.monotonic() + 10  # the daemon notes the write after it returns
        while True:
            assert cli(["status", "--controller", daemon.address, "--json"]) == 0
            taps = json.loads(capsys.readouterr().out)["taps"]
            if taps and taps[0]["last_step_id"] == 5 or time.monotonic() > deadline:
                break
        assert len(taps) == 1 and taps[0]["include_payloads"], taps
        assert taps[0]["last_step_id"] == 5 and taps[0]["queued"] == 0, taps
        assert taps[0]["delivered"] >= 5 and taps[0]["peer"].startswith("ipv4:127.0.0.1:")
        assert cli(["status", "--controller", daemon.address]) == 0
        out = capsys.readouterr().out
        assert "TAP (LIVE STREAM)" in out and "BEHIND" in out
        line = next(x for x in out.splitlines() if x.startswith(taps[0]["peer"]))
        assert line.split()[-2:] == ["5", "0"], line
    finally:
        channel.close()
        attn.close()
        ffn.close()


def test_status_require_serving_fails_until_the_set_is_complete(start_daemon, capsys):
    """The tls overlay's readiness probe (`afd-ctl status --require-serving`, over mTLS where
    the kubelet's grpc probe cannot go): exit 3 while the daemon is not SERVING, 0 once it is;
    without the flag, status exits 0 whatever the health (issue 39, manifests)."""
    from afd_ctl.client import ControllerClient
    from afd_ctl.membership import ATTENTION, FFN, WorkerSpec

    daemon = start_daemon()
    assert cli(["status", "--controller", daemon.address]) == 0
    assert cli(["status", "--controller", daemon.address, "--require-serving"]) == 3
    assert "health is NOT_SERVING, not SERVING" in capsys.readouterr().err
    workers = [
        ControllerClient(daemon.address, WorkerSpec("a-0", ATTENTION)),
        ControllerClient(daemon.address, WorkerSpec("f-0", FFN)),
    ]
    try:
        for worker in workers:
            worker.connect(10)
        workers[0].wait_complete(10)
        assert cli(["status", "--controller", daemon.address, "--require-serving"]) == 0
    finally:
        for worker in workers:
            worker.close()


@pytest.mark.parametrize(
    "address,said",
    [
        ("127.0.0.1:{port}", "nothing listens at 127.0.0.1:"),
        ("nosuch.invalid:50051", "does not resolve"),
    ],
)
def test_nothing_listening_or_no_such_host_is_said_within_seconds(address: str, said: str):
    """Issue 38: connection refused on every try (or a name that does not resolve) is certain
    within seconds, unlike a host that does not answer: the start-up query ends after
    refused_timeout_s, not after connect_timeout_s (120 s by default)."""
    from vllm_ext.control import ControlAccess, expected_counts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = address.format(port=s.getsockname()[1])  # nothing listens once closed
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=said) as caught:
        expected_counts(ControlAccess(address, refused_timeout_s=2.0), timeout_s=60)
    assert time.monotonic() - start < 10
    assert "refused_timeout_s" in str(caught.value) and "\n" not in str(caught.value)
    if "nothing listens" in said:
        assert "start `afd-ctl serve` there" in str(caught.value), caught.value
        assert "or fix --afd-controller" in str(caught.value), caught.value


def test_a_host_that_answers_nothing_is_waited_for_the_connect_bound():
    """Issue 38: only refusals (and names that do not resolve) end the wait early; a host that
    takes the connection and never answers (a stand-in for dropped packets: a socket that
    listens and never accepts) is waited for connect_timeout_s, as the README's table says."""
    from vllm_ext.control import ControlAccess, expected_counts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        address = f"127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            expected_counts(ControlAccess(address, refused_timeout_s=1.0), timeout_s=4)
        took = time.monotonic() - start
    said = str(caught.value)
    assert said.startswith(f"afd-ctl at {address}") and "did not answer within 4 s" in said
    assert "is `afd-ctl serve` running there" in said and "\n" not in said, said
    assert 4 <= took < 10, took


def test_a_worker_waiting_for_its_peers_says_how_long_in_one_phrase(start_daemon):
    """Issue 38: the FFN server's wait line read "waiting 30 s so far ... incomplete after
    0.1 s" (its poll bound); it now says the wait once (vllm_ext/ffn/server.py logs this)."""
    from afd_ctl.client import ControllerClient
    from afd_ctl.membership import FFN, WorkerSpec

    daemon = start_daemon()
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN))
    try:
        ffn.connect(10)
        message = ffn.incomplete_message("for 30 s so far")
        assert message.startswith(
            "the expected set (1 attention, 1 ffn) is incomplete for 30 s so far; "
        ), message
        assert "after" not in message
    finally:
        ffn.close()


@pytest.mark.parametrize("where", ["missing-folder/trace.json", "."])
def test_trace_to_an_unwritable_path_says_so_in_one_line_before_recording(
    tmp_path: Path, where: str
):
    """Issue 39: `afd-ctl trace --out` to a path it cannot write recorded the steps first and
    then failed with a traceback. Nothing listens at the address here: the path is checked
    before the daemon is asked anything."""
    out_path = tmp_path / where
    argv = ["trace", "--controller", "127.0.0.1:1", "--steps", "3", "--out", str(out_path)]
    out = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("afd-ctl trace: cannot write"), (
        out.stderr
    )
    assert f"--out {out_path}" in out.stderr and "nothing was recorded" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left behind


def test_an_older_cli_shows_event_kinds_a_newer_daemon_added_instead_of_failing():
    """A daemon newer than the CLI may send enum values the CLI does not know (the elastic
    membership's event kinds crashed an older `afd-ctl status` with "Enum Kind has no name
    defined for value 6"): it prints UNKNOWN_<value> instead."""
    from afd_ctl.cli_text import format_status

    status = afd_pb2.Status(health="SERVING", epoch=3)
    status.recent_events.add(kind=99)
    assert "UNKNOWN_99" in format_status(status)


def test_a_failed_start_of_ours_is_logged_as_one_line(tmp_path: Path, monkeypatch):
    """Issue 38: vLLM logs a worker's failed start with its traceback (~35 lines through our
    code) and the engine core's with its own; under a `vllm serve` with AFD settings the
    records become one line naming our reason (noted for the API server's last line), and a
    failure that is not ours keeps its traceback (tests/test_vllm_start_errors.py: end to end)."""
    from afd_ctl.errors import AfdRejected
    from vllm_ext import startup_errors

    reason_file = tmp_path / "reason.txt"
    monkeypatch.setenv(startup_errors.REASON_ENV, str(reason_file))
    monkeypatch.setattr(sys, "tracebacklimit", 1000, raising=False)  # the filter sets it
    shorten = startup_errors._FirstFailure("failed to start")

    def record(exc: BaseException, msg: str) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("vllm.x", logging.ERROR, "f", 1, msg, (), sys.exc_info())

    theirs = record(RuntimeError("WorkerProc initialization failed"), "EngineCore failed to start.")
    assert shorten.filter(theirs) and theirs.exc_info is not None  # no reason of ours yet
    ours = record(
        AfdRejected("FAILED_PRECONDITION", "model mismatch: x"), "WorkerProc failed to start."
    )
    assert shorten.filter(ours) and ours.exc_info is None and ours.exc_text is None
    said = logging.Formatter().format(ours)
    assert said == "WorkerProc failed to start: FAILED_PRECONDITION: model mismatch: x", said
    assert reason_file.read_text() == "FAILED_PRECONDITION: model mismatch: x"
    # The engine core's record after a worker noted the reason: one line too.
    engine = record(RuntimeError("WorkerProc initialization failed"), "EngineCore failed to start.")
    shorten.filter(engine)
    assert (
        logging.Formatter()
        .format(engine)
        .endswith("failed to start: FAILED_PRECONDITION: model mismatch: x")
    )
    later = record(AfdRejected("UNAVAILABLE", "y"), "WorkerProc failed.")  # not a start-up record
    shorten.filter(later)
    assert later.exc_info is not None
