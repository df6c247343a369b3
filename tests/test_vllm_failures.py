"""An FFN server killed with kill -9 under a real `vllm serve --afd-role attention`: the request
in flight fails with a clear error within 10 s, the attention server stays up and reports 503 on
/health, and once an FFN server is started again it is healthy and answers as before. Before
that, on the same 1:1 pair (one start for the module), a freeze of either side that only the
other's data plane sees heals through a new epoch."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.procs import Daemon, Proc  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    ffn_argv,
    free_port,
    post_json,
    serve_argv,
    vllm_env,
    wait_http_ok,
)


@pytest.fixture(scope="module")
def tiny_model(tiny_v2: Path) -> Path:
    return tiny_v2


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def stream_and_kill(url: str, body: dict, victim: Proc) -> tuple[list[dict], float, float]:
    """Streams a long request (230 tokens) and kill -9s `victim` once its tokens flow:
    (the stream's events, killed at, stream ended at; killed at is 0 if it never flowed)."""
    long_body = {**body, "max_tokens": 230, "stream": True}
    req = urllib.request.Request(
        url, data=json.dumps(long_body).encode(), headers={"Content-Type": "application/json"}
    )
    events: list[dict] = []
    killed_at = 0.0
    with urllib.request.urlopen(req, timeout=60) as stream:
        for raw in stream:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 2:
                victim.signal(signal.SIGKILL)
                killed_at = time.monotonic()
    return events, killed_at, time.monotonic()


def post_error(url: str, body: dict) -> tuple[int, str]:
    """(status, body) of a request expected to fail."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_status(url: str, want: int, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if http_status(url) == want:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer {want} within {timeout_s} s")


# The attention server's worker in its engine core's process (vLLM's uni executor: CPU vLLM
# runs it only with VLLM_ENABLE_V1_MULTIPROCESSING=0, GPU vLLM by default at TP=1): a process
# fewer, about 6 s of the 2 cores per start, for the tests whose point is not the worker's
# process (this module's pair, the restart, metrics, security and elastic tests; the `vllm
# serve` DP=2 tests keep vLLM's CPU default, a worker process per engine, FFN kill included).
UNI_EXECUTOR = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class AfdServers:
    """afd-ctl, one FFN `vllm serve` and one attention `vllm serve`, healthy."""

    daemon: Any
    ffn: Proc
    attention: Proc
    health: str
    url: str
    body: dict
    before: str  # the answer to `body` while everything is up


def start_afd_servers(
    model: Path, start_daemon, procs: list[Proc], tmp_path: Path, *, dp: int = 1,
    ffn_env: dict[str, str] | None = None, attention_env: dict[str, str] | None = None,
) -> AfdServers:  # fmt: skip
    daemon = start_daemon("--expect-attention", str(dp), "--expect-ffn", "1")
    ffn = Proc(ffn_argv(model, daemon.address), tmp_path / "ffn.log", vllm_env(ffn_env))
    procs.append(ffn)
    port = free_port()
    dp_flags = ["--data-parallel-size", str(dp)] if dp > 1 else []
    attention = Proc(
        serve_argv(
            model, port, *dp_flags, "--afd-role", "attention", "--afd-controller", daemon.address
        ),
        tmp_path / "attention.log",
        vllm_env(attention_env),
    )
    procs.append(attention)
    health = f"http://127.0.0.1:{port}/health"
    url = f"http://127.0.0.1:{port}/v1/completions"
    wait_http_ok(health, 240, attention.popen)
    body = {"model": str(model), "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    before = post_json(url, body)["choices"][0]["text"]
    return AfdServers(daemon, ffn, attention, health, url, body, before)


def answered_again(servers: AfdServers, timeout_s: float = 60) -> str:
    """Asks until the request succeeds again (failing meanwhile is expected); its text."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, text = post_error(servers.url, servers.body)
        if status == 200:
            return json.loads(text)["choices"][0]["text"]
        assert time.monotonic() < deadline, f"still failing: {status} {text}"
        time.sleep(1)


def ffn_kill_fails_the_request_then_recovers(
    servers: AfdServers, model: Path, ffn_tmp: Path, procs: list[Proc], tmp_path: Path,
    dp: int = 1, ffn_extra: Sequence[str] = (), peers: int = 1,
) -> Proc:  # fmt: skip
    """kill -9 of the FFN server `servers.ffn` (started with TMPDIR `ffn_tmp`) while a long
    request streams: the stream ends with the 503 error event within 10 s, the attention
    server stays up with /health 503 and fails new requests at once; a new FFN server (its
    flags `ffn_extra`: an expert-parallel rank's, say): /health 200 and the same answer as
    before the kill (every DP engine reconnected to its `peers` FFN servers). Returns the new
    FFN server."""
    health, url, body = servers.health, servers.url, servers.body
    # Counted from here: a pair that other tests used has failed and reconnected before.
    failed_before = servers.attention.log().count("failed 1 running request(s)")
    reconnects_before = servers.attention.log().count(f"reconnected to {peers} ffn peer(s)")
    events, killed_at, ended_at = stream_and_kill(url, body, servers.ffn)
    assert len(events) >= 2, events
    assert ended_at - killed_at < 10, f"the request ended {ended_at - killed_at:.1f} s after"
    errors = [e["error"] for e in events if "error" in e]
    assert errors, f"the stream ended without an error: {events[-3:]}"
    assert "AFD FFN side" in errors[-1]["message"], errors[-1]
    assert errors[-1]["type"] == "ServiceUnavailableError", errors[-1]  # as a plain 503
    tokens = sum(len(e["choices"][0]["text"]) > 0 for e in events if "choices" in e)
    assert tokens < 230, "the request finished although its FFN server was killed"
    # Nothing of the killed server's left in its temp folder (its rendezvous store is a TCP
    # store in its own process, vllm_ext.ffn.engine's one-rank world).
    assert not list(ffn_tmp.iterdir()), list(ffn_tmp.iterdir())

    # The attention server stays up, reports unhealthy and fails new requests at once.
    wait_status(health, 503, 10)
    start = time.monotonic()
    status, text = post_error(url, body)
    assert status == 503 and "GET /health" in text, (status, text)
    assert time.monotonic() - start < 10
    assert servers.attention.popen.poll() is None, servers.attention.tail()

    # A new FFN server: healthy again, and the same answer as before the kill.
    ffn2 = Proc(
        ffn_argv(model, servers.daemon.address, *ffn_extra), tmp_path / "ffn2.log", vllm_env()
    )
    procs.append(ffn2)
    wait_status(health, 200, 240 if peers > 1 else 180)
    if peers > 1:
        # With several FFN servers, the first step after the new epoch may still fail once (an
        # idle DP engine's dummy batch meeting a surviving rank's last step of the old epoch):
        # requests succeed again within a bound, with the same tokens.
        assert answered_again(servers) == servers.before
    else:
        assert post_json(url, body)["choices"][0]["text"] == servers.before
    log = servers.attention.log()
    assert log.count("failed 1 running request(s)") > failed_before, servers.attention.tail()
    reconnects = log.count(f"reconnected to {peers} ffn peer(s)") - reconnects_before
    assert reconnects >= dp, servers.attention.tail()
    return ffn2


@dataclass
class SharedPair:
    """The module's one 1:1 pair (short_bound_pair), each side with a temporary folder of its
    own, and the list its tests add processes to (stopped at the module's end)."""

    servers: AfdServers
    ffn_tmp: Path
    attention_tmp: Path
    root: Path
    procs: list[Proc]


@pytest.fixture(scope="module")
def short_bound_pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedPair]:
    """One 1:1 pair for the module's three tests (a start costs 25-30 s of the 2 cores): the
    two data-plane-only losses, each leaving the pair serving, then the FFN kill, which stops
    it. Each side's step bound is 0.5 s: far below afd-ctl's liveness bound, so a freeze of
    about a second is seen by the data plane only. The attention server's temporary folder is
    one of its own outside pytest's (there the path of vLLM's IPC sockets would be longer than
    a socket's path may be)."""
    root = tmp_path_factory.mktemp("short-bounds")
    ffn_tmp, attention_tmp = root / "ffn-tmp", Path(tempfile.mkdtemp(prefix="afd-t-"))
    ffn_tmp.mkdir()
    started: list[Proc] = []

    def daemon(*args: str) -> Daemon:
        started.append(proc := Daemon(root / f"daemon-{len(started)}.log", *args))
        return proc

    bound = {"AFD_STEP_TIMEOUT_S": "0.5"}
    try:
        servers = start_afd_servers(
            tiny_model, daemon, started, root, ffn_env={**bound, "TMPDIR": str(ffn_tmp)},
            attention_env={**bound, **UNI_EXECUTOR, "TMPDIR": str(attention_tmp)},
        )  # fmt: skip
        yield SharedPair(servers, ffn_tmp, attention_tmp, root, started)
    finally:
        for proc in started:
            proc.stop()
        shutil.rmtree(attention_tmp, ignore_errors=True)


@pytest.mark.timeout(600)
@pytest.mark.line_independent
def test_a_loss_only_the_data_plane_sees_heals_through_a_new_epoch(
    short_bound_pair: SharedPair,
) -> None:
    """The FFN server freezes (SIGSTOP) longer than the attention side's step bound but not as
    long as afd-ctl's liveness bound: only the attention side's data plane calls it lost, and
    afd-ctl still sees everyone in the same epoch, so no new view would ever come by itself.
    The attention worker rejoins afd-ctl; the new epoch reconnects both sides and requests
    succeed again, without restarting anything."""
    servers = short_bound_pair.servers
    ffn, attention = servers.ffn, servers.attention

    ffn.signal(signal.SIGSTOP)
    try:
        status, _ = post_error(servers.url, {**servers.body, "max_tokens": 200})
        assert status == 503
    finally:
        time.sleep(0.5)
        ffn.signal(signal.SIGCONT)
    # Requests fail until the attention worker has rejoined, then succeed again.
    assert answered_again(servers) == servers.before
    assert "rejoining" in attention.log(), attention.tail()
    assert attention.popen.poll() is None and ffn.popen.poll() is None


@pytest.mark.timeout(600)
@pytest.mark.line_independent
def test_a_loss_only_the_ffn_data_plane_sees_heals_through_a_new_epoch(
    short_bound_pair: SharedPair,
) -> None:
    """The attention server freezes (SIGSTOP) mid-decode for longer than the FFN server's
    step bound but not afd-ctl's liveness bound: only the FFN's data plane calls it lost. The
    FFN server rejoins afd-ctl; the new epoch reconnects both sides and requests succeed.
    (On the pair the test above leaves serving: the FFN's rejoins are counted from here.)"""
    servers = short_bound_pair.servers
    ffn, attention = servers.ffn, servers.attention
    rejoins = ffn.log().count("rejoin in a new epoch")

    long_body = {**servers.body, "max_tokens": 230, "stream": True}
    # A freeze that lands between two steps costs the FFN nothing (it waits for the next
    # payload without a bound), so freeze again; on 2 cores about half the freezes land
    # between steps, and 5 tries missed in one CI run out of several.
    for _ in range(10):
        thread = threading.Thread(target=post_error, args=(servers.url, long_body), daemon=True)
        thread.start()
        time.sleep(0.5)  # decoding
        attention.signal(signal.SIGSTOP)
        time.sleep(1.2)
        attention.signal(signal.SIGCONT)
        thread.join(60)
        if ffn.log().count("rejoin in a new epoch") > rejoins:
            break
    assert ffn.log().count("rejoin in a new epoch") > rejoins, ffn.tail()
    assert answered_again(servers) == servers.before
    assert attention.popen.poll() is None and ffn.popen.poll() is None


@pytest.mark.timeout(600)
# vLLM 0.32: on 0.26 that line's failed-step seams run in test_vllm_serve's DP=2 DeepSeek-V2
# case, on the servers it starts anyway; attention DP=2 (the idle engine's dummy batches fail
# too, both engines reconnect, each engine's worker in a process of its own) is on 0.32 the
# DeepSeek-V3 expert-parallel 2:2 case of test_vllm_expert_parallel, whose rank loss is its FFN
# kill. The IPC socket folder's seam has its test on both lines in
# test_vllm_compat. Last in this module: it stops the shared pair.
def test_ffn_kill_fails_the_request_and_attention_recovers(
    tiny_model: Path, short_bound_pair: SharedPair
) -> None:
    """On the pair the data-plane-only losses above leave serving: the FFN server killed
    (kill -9) mid-request, the 503, /health, a new FFN server and the same answers
    (ffn_kill_fails_the_request_then_recovers); vLLM's IPC sockets in a folder of the
    attention server's own, gone once it stops; the stop ends the new FFN server cleanly."""
    pair = short_bound_pair
    servers = pair.servers
    # Serving first: a failure above must not show up here as a stream that fails at once.
    assert answered_again(servers) == servers.before
    ffn2 = ffn_kill_fails_the_request_then_recovers(
        servers, tiny_model, pair.ffn_tmp, pair.procs, pair.root
    )
    # vLLM's IPC sockets are in a folder of the attention server's own while it runs
    # (compat.ipc_sockets), and gone with it once it stops.
    (ipc_folder,) = pair.attention_tmp.glob("afd-ipc-*")
    assert any(p.is_socket() for p in ipc_folder.iterdir()), list(ipc_folder.iterdir())
    servers.attention.signal(signal.SIGTERM)
    assert servers.attention.wait(60) == 0, servers.attention.tail()
    assert ffn2.wait(30) == 0, ffn2.tail()
    left = [p for p in pair.attention_tmp.rglob("*") if p.is_socket() or "afd-ipc-" in p.name]
    assert not left, f"a stopped attention server left {left}"
