"""Data plane (afd_data) over real NIXL agents.

End-to-end tests run every worker as its own process (tests/data_plane_worker.py, one NIXL agent
each, host DRAM through UCX) and exchange blobs through files. The refusal tests run the
transport in this process against ``FakePeer``: a real NIXL agent driven by hand, so that a test
can send exactly the malformed, stale or early notification it needs (no real worker sends
those on purpose).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afd_ctl.step import Step
from afd_data import (
    AfdBadInput,
    AfdPeerLost,
    AfdProtocolError,
    AfdStaleEpoch,
    NixlTransport,
    Role,
    TransportConfig,
    notify,
)
from afd_data.blob import PeerBlob, decode_blob, encode_blob
from afd_data.layout import BufferLayout
from afd_data.notify import Kind
from afd_data.routing import max_peers, peer_ranks
from afd_data.step_plan import PeerSlice, plan_step
from tests.data_plane_worker import step_counts
from tests.procs import Proc

WORKER = Path(__file__).with_name("data_plane_worker.py")
# cpu: host DRAM (CI). On a GPU machine AFD_TEST_DEVICE=cuda:0 runs the same multi-process
# tests VRAM to VRAM (both processes on one GPU).
DEVICE = os.environ.get("AFD_TEST_DEVICE", "cpu")
REPO = WORKER.parent.parent


# ---------------------------------------------------------------------------- processes


def start_worker(
    procs: list[Proc],
    tmp: Path,
    controller: str,
    role: str,
    rank: int,
    config: dict[str, Any],
    *args: str,
) -> Proc:
    """A data_plane_worker.py process; its JSON events land in its log."""
    log = tmp / f"{role}-{rank}-{len(procs)}.log"
    argv = [
        sys.executable,
        str(WORKER),
        "--role",
        role,
        "--rank",
        str(rank),
        "--controller",
        controller,
        "--config",
        json.dumps(config),
        "--device",
        DEVICE,
        *args,
    ]
    proc = Proc(argv, log)
    procs.append(proc)
    return proc


def wait_event(proc: Proc, name: str, timeout_s: float) -> dict[str, Any]:
    return json.loads(proc.wait_for(rf'(?m)^\{{"event": "{name}".*\}}$', timeout_s).group(0))


def finish(proc: Proc, timeout_s: float) -> dict[str, Any]:
    """Waits for the 'done' event (the worker then stays registered until STOP)."""
    if proc.popen.poll() not in (None, 0):
        raise AssertionError(f"{proc.argv[2:6]} exited {proc.popen.returncode}:\n{proc.tail()}")
    return wait_event(proc, "done", timeout_s)


def stop_all(daemon: Any, workers: list[Proc]) -> None:
    """SIGTERM drains the daemon: every worker is told (DAEMON_DRAINING) and exits 0."""
    daemon.signal(signal.SIGTERM)
    for w in workers:
        try:
            rc = w.wait(30)
        except AssertionError:  # still running: where it is (data_plane_worker's SIGUSR1)
            w.signal(signal.SIGUSR1)
            w.wait_for(r"(?m)^(Current thread|Thread) 0x", 10)
            raise AssertionError(
                f"{w.argv[2:6]} did not exit; its threads:\n{w.tail(80)}"
            ) from None
        assert rc == 0, f"{w.argv[2:6]} exited {rc}:\n{w.tail()}"
    assert daemon.wait(30) == 0


@pytest.fixture
def spawn(procs: list[Proc], tmp_path: Path, start_daemon):
    """Starts workers against one afd-ctl daemon, started with the first worker's M:N (and its
    FFN groups, as --expert-parallel-size N / groups)."""
    daemon: list[Any] = []

    def start(role: str, rank: int, config: dict[str, Any], *args: str) -> Proc:
        if not daemon:
            m, n = config.get("num_attention", 1), config.get("num_ffn", 1)
            groups = config.get("ffn_groups")
            ep = ("--expert-parallel-size", str(n // groups)) if groups else ()
            daemon.append(start_daemon("--expect-attention", str(m), "--expect-ffn", str(n), *ep))
            start.daemon = daemon[0]  # type: ignore[attr-defined]
        return start_worker(procs, tmp_path, daemon[0].address, role, rank, config, *args)

    return start


def start_all(spawn, m: int, n: int, config: dict[str, Any], *args: str) -> list[Proc]:
    return [spawn("ffn", r, config, *args) for r in range(n)] + [
        spawn("attention", r, config, *args) for r in range(m)
    ]


# ---------------------------------------------------------------------------- end to end

CASES: list[tuple[int, int, int, dict[str, Any]]] = [
    # (M, N, stages, extra config)
    (1, 1, 1, {}),
    (1, 1, 2, {"dtype": "float16"}),
    (2, 1, 1, {}),
    (2, 1, 2, {"router_width": 8, "router_dtype": "int32"}),
    (1, 2, 1, {"router_width": 8, "router_dtype": "float32"}),
    (1, 2, 2, {}),
    (3, 2, 1, {"dtype": "float32"}),
    (3, 2, 2, {"router_width": 4, "router_dtype": "int32"}),
    # One FFN group (--expert-parallel-size 2): both attention ranks reach both FFN ranks.
    (2, 2, 2, {"ffn_groups": 1, "router_width": 4, "router_dtype": "int32"}),
]


@pytest.mark.parametrize(
    ("m", "n", "stages", "extra"),
    CASES,
    ids=[
        f"{m}to{n}-{s}stage-{e.get('dtype', 'bf16')}"
        + ("-router" if "router_width" in e else "")
        + (f"-{e['ffn_groups']}group" if "ffn_groups" in e else "")
        for m, n, s, e in CASES
    ],
)
def test_bytes_arrive_intact(spawn, m: int, n: int, stages: int, extra: dict[str, Any]) -> None:
    """Hundreds of steps with random per-step token counts (idle ranks included), every byte
    checked on both sides. With two stages, both stages and two layers are in flight at once
    (layers_in_flight=2), which is what the flow control has to keep apart."""
    config = {
        "hidden_size": 64,
        "max_tokens_per_peer": 24,
        "num_stages": stages,
        "layers_in_flight": stages,
        "num_attention": m,
        "num_ffn": n,
        **extra,
    }
    steps, layers, seed = 200, 3, m * 10 + n
    workers = start_all(
        spawn,
        m,
        n,
        config,
        "--steps",
        str(steps),
        "--layers",
        str(layers),
        "--stages",
        str(stages),
        "--depth",
        str(stages),
        "--seed",
        str(seed),
    )
    done = [finish(w, 90) for w in workers]
    stop_all(spawn.daemon, workers)
    # Every row an attention rank sent was checked by each FFN peer, and every output row it
    # got back was checked by it: both totals equal what the step plans say, all steps run.
    cfg = TransportConfig(**config)
    row_bytes = cfg.hidden_size * cfg.itemsize
    expected = 0
    for i in range(steps):
        counts = step_counts(seed, 1_000_000 + i, stages, m, cfg.max_tokens_per_peer)
        for a in range(m):
            fan_out = len(peer_ranks(Role.ATTENTION, a, m, n, groups=cfg.ffn_groups))
            expected += sum(max(1, counts[s][a]) for s in range(stages)) * fan_out
    expected *= layers * row_bytes
    assert sum(d["checked_bytes"] for d in done[:n]) == expected  # FFN side
    assert sum(d["checked_bytes"] for d in done[n:]) == expected  # attention side


def test_ffn_carrying_two_stages_serves_one_stage_attention(spawn) -> None:
    """FFN workers carry two stages (what a vLLM FFN server does by default, to follow
    attention servers with or without dual-batch overlap); their attention peers carry one.
    Stage 0 lies at the same place in both layouts, so every byte arrives intact both ways."""
    m, n, steps, layers, seed = 2, 2, 60, 3, 7
    base = {
        "hidden_size": 48,
        "max_tokens_per_peer": 16,
        "layers_in_flight": 2,
        "num_attention": m,
        "num_ffn": n,
        "router_width": 4,
        "router_dtype": "int32",
    }
    args = ("--steps", str(steps), "--layers", str(layers), "--depth", "2", "--seed", str(seed))
    workers = [spawn("ffn", r, {**base, "num_stages": 2}, *args) for r in range(n)]
    workers += [spawn("attention", r, {**base, "num_stages": 1}, *args) for r in range(m)]
    done = [finish(w, 90) for w in workers]
    stop_all(spawn.daemon, workers)
    cfg = TransportConfig(**base)
    expected = 0
    for i in range(steps):
        counts = step_counts(seed, 1_000_000 + i, 1, m, cfg.max_tokens_per_peer)
        for a in range(m):
            expected += max(1, counts[0][a]) * len(peer_ranks(Role.ATTENTION, a, m, n))
    expected *= layers * cfg.hidden_size * cfg.itemsize
    assert sum(d["checked_bytes"] for d in done[:n]) == expected
    assert sum(d["checked_bytes"] for d in done[n:]) == expected


def test_ffn_killed_mid_step_then_replaced(spawn) -> None:
    """kill -9 of the FFN worker while the attention side waits for its output: the attention
    side raises AfdPeerLost well inside its receive bound (a probe meets the disconnect), then
    reconnects at the next epoch to a replacement FFN worker and runs verified steps again."""
    config = {"hidden_size": 32, "max_tokens_per_peer": 8, "probe_interval_s": 0.05}
    recv_bound_s = 20.0
    attn = spawn(
        "attention",
        0,
        config,
        "--steps",
        "100000",
        "--timeout",
        str(recv_bound_s),
        "--survive",
        "60",
    )
    ffn = spawn("ffn", 0, config, "--steps", "100000", "--hang-at-step", "1000030")
    wait_event(ffn, "hang", 60)
    time.sleep(0.3)  # the attention side is now deep in recv_outputs
    killed_at = time.time()
    ffn.signal(signal.SIGKILL)
    lost = wait_event(attn, "peer_lost", recv_bound_s + 5)
    detect_s = lost["t"] - killed_at
    assert lost["message"].startswith("afd peer lost: ffn rank 0"), lost["message"]
    print(f"detected in {detect_s:.3f} s: {lost['message']}")
    assert detect_s < 3.0, f"took {detect_s:.2f} s to notice the dead FFN worker"

    replacement = spawn("ffn", 0, config, "--round", "2", "--steps", "60")
    new, old = finish(replacement, 60), finish(attn, 60)
    assert new["round"] == old["round"] == 2
    assert new["epoch"] == old["epoch"] > wait_event(attn, "connected", 1)["epoch"]


def test_attention_killed_ffn_errors_all_reconnect(spawn) -> None:
    """2:1. kill -9 of attention rank 1 mid-step: the FFN worker raises AfdPeerLost naming it
    within the bound; attention rank 0, whose FFN stopped answering, hits its own receive bound.
    All reconnect at epoch 2 with a replacement rank 1 and run verified steps."""
    config = {
        "hidden_size": 32,
        "max_tokens_per_peer": 8,
        "num_attention": 2,
        "probe_interval_s": 0.05,
    }
    ffn = spawn("ffn", 0, config, "--steps", "100000", "--timeout", "20", "--survive", "40")
    attn0 = spawn(
        "attention", 0, config, "--steps", "100000", "--timeout", "1.5", "--survive", "40"
    )
    attn1 = spawn("attention", 1, config, "--steps", "100000", "--hang-at-step", "1000020")
    wait_event(attn1, "hang", 60)
    time.sleep(0.3)
    killed_at = time.time()
    attn1.signal(signal.SIGKILL)
    lost = wait_event(ffn, "peer_lost", 10)
    assert lost["message"].startswith("afd peer lost: attention rank 1"), lost["message"]
    print(f"detected in {lost['t'] - killed_at:.3f} s: {lost['message']}")
    assert lost["t"] - killed_at < 3.0
    lost0 = wait_event(attn0, "peer_lost", 10)
    assert "no outputs" in lost0["message"] and "within 1.5 s" in lost0["message"]

    replacement = spawn("attention", 1, config, "--round", "2", "--steps", "40")
    done = [finish(w, 60) for w in (replacement, attn0, ffn)]
    assert {d["round"] for d in done} == {2} and len({d["epoch"] for d in done}) == 1


# ---------------------------------------------------------------------------- refusals


class FakePeer:
    """A real NIXL agent posing as a peer, driven by the test (same process, own thread to keep
    its UCX worker progressing). It publishes a valid blob, so a transport connects to it, and
    then sends exactly the notifications a test needs."""

    def __init__(self, name: str, role: Role, rank: int, config: TransportConfig):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.role = role
        self.rank = rank
        self.layout = BufferLayout(config, role)
        self._lock = threading.Lock()
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False))
        self.buf = np.zeros(self.layout.total_bytes, dtype=np.uint8)
        addr = self.buf.__array_interface__["data"][0]
        self.reg = self.agent.register_memory(
            np.array([[addr, self.buf.nbytes, 0]], dtype=np.uint64), "DRAM"
        )
        self.blob = encode_blob(
            PeerBlob(
                name,
                self.agent.get_agent_metadata(),
                role,
                rank,
                "DRAM",
                addr,
                self.layout.recv_bytes,
                0,
                config.shape_fields(),
            )
        )
        self.received: list[notify.Notice] = []
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run, daemon=True)
        self._pump.start()

    def spec(self) -> tuple[Role, int, int, bytes]:
        return (self.role, self.rank, self.rank, self.blob)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                notifs = self.agent.get_new_notifs()
            for agent_name, msgs in notifs.items():
                self.received += [notify.unpack(m, agent_name) for m in msgs]
            time.sleep(0.0005)

    def attach(self, transport: NixlTransport) -> None:
        with self._lock:
            self.agent.add_remote_agent(decode_blob(transport.blob()).agent_metadata)

    def send(self, target: NixlTransport, msg: bytes) -> None:
        with self._lock:
            self.agent.send_notif(target.name, msg)

    def notice(self, target: NixlTransport, **fields: int) -> None:
        kind = Kind.HIDDEN if self.role is Role.ATTENTION else Kind.OUTPUT
        values: dict[str, Any] = {
            "epoch": target.epoch,
            "step": target.step_id,
            "layer": 0,
            "stage": 0,
            "src": self.rank,
            "rows": 1,
            **fields,
        }
        self.send(target, notify.pack(kind, **values))

    def wait_received(self, count: int, timeout_s: float = 5.0) -> list[notify.Notice]:
        deadline = time.monotonic() + timeout_s
        while len([n for n in self.received if n.kind is not Kind.PROBE]) < count:
            assert time.monotonic() < deadline, f"{self.name} got {self.received}"
            time.sleep(0.005)
        return [n for n in self.received if n.kind is not Kind.PROBE]

    def close(self) -> None:
        self._stop.set()
        self._pump.join(5)


SMALL: dict[str, Any] = {
    "hidden_size": 16,
    "max_tokens_per_peer": 4,
    "recv_timeout_s": 5.0,
    "probe_interval_s": 0.05,
}


@pytest.fixture
def pair(request):
    """A transport of one role connected (epoch 3) to a FakePeer of the other."""
    closers: list[Any] = []

    def make(role: str, **overrides: Any) -> tuple[NixlTransport, FakePeer]:
        cfg = TransportConfig(**{**SMALL, **overrides})
        t = NixlTransport(f"{role}-t-{os.getpid()}-{len(closers)}", role, 0, cfg)
        fake = FakePeer(f"fake-{os.getpid()}-{len(closers)}", Role.parse(role).other, 0, cfg)
        closers.extend([t.close, fake.close])
        t.connect(3, [fake.spec()])
        fake.attach(t)
        return t, fake

    yield make
    for close in closers:
        close()


def test_config_refuses_bad_values() -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"num_stages": 3}, "num_stages"),
        ({"dtype": "int8"}, "dtype"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention": 3, "attention_tp_size": 2}, "attention_tp_size"),
        ({"router_width": -1}, "router_width"),
    ]
    for fields, named in bad:
        with pytest.raises(AfdBadInput, match=named):
            TransportConfig(**{**SMALL, **fields})
    cfg = TransportConfig.from_env(
        {"AFD_DATA_NUM_STAGES": "2"}, hidden_size=8, max_tokens_per_peer=2, dtype="bf16"
    )
    assert (cfg.num_stages, cfg.dtype, cfg.itemsize) == (2, "bfloat16", 2)
    with pytest.raises(AfdBadInput, match="AFD_DATA_NUM_STAGES"):
        TransportConfig.from_env(
            {"AFD_DATA_NUM_STAGES": "two"}, hidden_size=8, max_tokens_per_peer=2
        )


def test_routing_and_blob() -> None:
    assert peer_ranks(Role.FFN, 0, 3, 2) == (0, 2)
    assert peer_ranks(Role.FFN, 1, 3, 2) == (1,)
    assert peer_ranks(Role.ATTENTION, 0, 1, 2) == (0, 1)
    assert max_peers(Role.FFN, 3, 2) == 2
    cfg = TransportConfig(**SMALL)
    blob = PeerBlob("a", b"md", Role.FFN, 1, "DRAM", 4096, 1024, 0, cfg.shape_fields())
    assert decode_blob(encode_blob(blob)) == blob
    with pytest.raises(AfdBadInput, match="not an afd.data.v1.DataPlaneBlob"):
        decode_blob(b"\xff\xff\xff garbage")


def test_step_plan_packs_peers_in_rank_order() -> None:
    """3:2 with an idle rank: FFN 0 packs attention 0 and 2; the idle one sends a dummy row."""
    cfg = TransportConfig(**{**SMALL, "num_attention": 3, "num_ffn": 2})
    counts = [[3, 2, 0]]
    ffn0 = plan_step(cfg, Role.FFN, 0, counts)
    assert ffn0.slices[0] == (PeerSlice(0, 0, 0, 3, 3), PeerSlice(2, 2, 3, 1, 0))
    assert ffn0.total_rows == [4]
    attn2 = plan_step(cfg, Role.ATTENTION, 2, counts)
    assert (attn2.my_rows, attn2.offsets) == ([1], [[3]])
    attn1 = plan_step(cfg, Role.ATTENTION, 1, counts)
    assert (attn1.my_rows, attn1.offsets) == ([2], [[0]])
    one_to_two = TransportConfig(**{**SMALL, "num_ffn": 2})
    assert plan_step(one_to_two, Role.ATTENTION, 0, [[4]]).offsets == [[0, 0]]


def test_connect_refuses_bad_peers(pair) -> None:
    t, fake = pair("ffn")
    cfg = t.config
    other_shape = TransportConfig(**{**SMALL, "hidden_size": 32})
    odd = FakePeer(f"odd-{os.getpid()}", Role.ATTENTION, 0, other_shape)
    dbo = FakePeer(f"dbo-{os.getpid()}", Role.ATTENTION, 0, TransportConfig(**SMALL, num_stages=2))
    try:
        cases = [
            ([(Role.ATTENTION, 0, 0, b"junk")], "not an afd.data.v1.DataPlaneBlob"),
            ([odd.spec()], "hidden_size: this worker 16, peer 32"),
            ([dbo.spec()], "attention side runs 2 stages .* FFN side carries 1; give the FFN"),
            ([(Role.FFN, 0, 0, fake.blob)], "connects to attention peers only"),
            ([(Role.ATTENTION, 1, 1, fake.blob)], "not routed"),
            ([], r"missing attention peer\(s\) \[0\]"),
        ]
        for peers, message in cases:
            with pytest.raises(AfdBadInput, match=message):
                t.connect(4, peers)
        assert t.epoch == 3  # nothing changed
        with pytest.raises(AfdStaleEpoch):
            t.connect(2, [fake.spec()])
    finally:
        odd.close()
        dbo.close()
    assert cfg.shape_fields()["hidden_size"] == 16


def test_connect_refuses_a_peer_of_other_ffn_groups(pair) -> None:
    """2:2 as two pairs against an attention peer that routes 2:2 as one group: refused, naming
    the setting, before anything changes."""
    t, _ = pair("ffn", num_attention=2, num_ffn=2)
    grouped = TransportConfig(**SMALL, num_attention=2, num_ffn=2, ffn_groups=1)
    other = FakePeer(f"grouped-{os.getpid()}", Role.ATTENTION, 0, grouped)
    try:
        with pytest.raises(AfdBadInput, match="ffn_groups: this worker 2, peer 1 .*--expert-paral"):
            t.connect(4, [other.spec()])
        assert t.epoch == 3
    finally:
        other.close()


def test_begin_step_refuses_bad_payloads(pair) -> None:
    t, _ = pair("ffn", num_stages=2)
    cases = [
        ([[5]], "exceeds max_tokens_per_peer 4"),
        ([[1, 2]], r"has 2 entries, the attention DP size is 1"),
        ([[-1]], "is negative"),
        ([[1], [1], [1]], r"3 stage\(s\)"),
        ({1: [1]}, "stage keys"),
    ]
    for counts, message in cases:
        with pytest.raises(ValueError, match=message):  # AfdBadInput is a ValueError
            t.begin_step(Step.of(7, counts))
    assert t.step_id is None  # nothing changed
    with pytest.raises(AfdStaleEpoch, match="epoch 2"):
        t.begin_step(Step.of(7, [[1]], epoch=2))
    with pytest.raises(AfdBadInput, match="reconnect"):
        t.begin_step(Step.of(7, [[1]], epoch=4))
    t.begin_step(Step.of(7, [[4], [0]], epoch=3))
    with pytest.raises(AfdBadInput, match="does not increase"):
        t.begin_step(Step.of(7, [[1]]))
    with pytest.raises(AfdBadInput, match="is for ffn workers|is for attention workers"):
        t.send_hidden(0, 0, np.zeros((4, 16), np.uint16))


def test_send_refuses_shape_and_dtype_then_delivers(pair) -> None:
    """Wrong shape, dtype or type is refused before anything moves; then a good send arrives
    intact at the FFN's packed receive slot with its notification."""
    t, fake = pair("attention")
    t.begin_step(Step.of(1, [[3]]))
    good = (np.arange(3 * 16, dtype=np.uint16) * 7).reshape(3, 16)
    for bad, message in [
        (np.zeros((2, 16), np.uint16), r"shape \(2, 16\) but this step expects \(3, 16\)"),
        (np.zeros((3, 8), np.uint16), r"shape \(3, 8\)"),
        (
            np.zeros((3, 16), np.float32),
            "dtype float32 but the transport is configured for bfloat16",
        ),
        (good.tolist(), "expected a numpy array"),
    ]:
        with pytest.raises(AfdBadInput, match=message):
            t.send_hidden(0, 0, bad)
    with pytest.raises(AfdBadInput, match="router_width is 0"):
        t.send_hidden(0, 0, good, np.zeros((3, 1), np.float32))
    with pytest.raises(AfdBadInput, match="no hidden states of that layer"):
        t.recv_outputs(0, 0)

    t.send_hidden(0, 0, good)
    t.flush()
    (n,) = fake.wait_received(1)
    assert (n.kind, n.epoch, n.step, n.layer, n.stage, n.src_rank, n.rows) == (
        Kind.HIDDEN,
        3,
        1,
        0,
        0,
        0,
        3,
    )
    region = fake.layout.recv_hidden[0]
    landed = fake.buf[region.offset : region.offset + good.nbytes].view(np.uint16)
    assert np.array_equal(landed.reshape(3, 16), good)


def test_flow_control_refuses_overwrite_until_reply(pair) -> None:
    """Two stages in flight are fine; the next layer in a slot whose reply has not been taken is
    refused, and the reply (the credit) frees it."""
    t, fake = pair("attention", num_stages=2, layers_in_flight=1)
    t.begin_step(Step.of(1, [[2], [1]]))
    t.send_hidden(0, 0, np.ones((2, 16), np.uint16))
    t.send_hidden(0, 1, np.ones((1, 16), np.uint16))
    with pytest.raises(AfdBadInput, match=r"overwrite .* call recv_outputs\(layer=0, stage=0\)"):
        t.send_hidden(1, 0, np.ones((2, 16), np.uint16))
    with pytest.raises(AfdBadInput, match="begin_step.* unanswered"):
        t.begin_step(Step.of(2, [[1], [1]]))
    fake.notice(t, layer=0, stage=0, rows=2)
    (out,) = t.recv_outputs(0, 0, timeout_s=5)
    assert out.shape == (2, 16)
    t.send_hidden(1, 0, np.ones((2, 16), np.uint16))  # the slot is free again
    with pytest.raises(AfdBadInput, match="layers must increase"):
        t.send_hidden(0, 1, np.ones((1, 16), np.uint16))


def test_notifications_for_unknown_step_or_epoch_are_refused(pair) -> None:
    """Each bad notification raises a typed error from the receive that meets it and is
    dropped; the transport then receives the good one."""
    t, fake = pair("ffn")
    t.begin_step(Step.of(10, [[3]]))
    cases = [
        (
            notify.pack(Kind.HIDDEN, 1, 10, 0, 0, 0, 3),
            AfdStaleEpoch,
            "epoch 1, which this transport never joined",
        ),
        (
            notify.pack(Kind.HIDDEN, 3, 9, 0, 0, 0, 3),
            AfdProtocolError,
            "unknown step, this rank is at step 10",
        ),
        (notify.pack(Kind.HIDDEN, 3, 10, 0, 0, 5, 3), AfdProtocolError, "not a attention peer"),
        (notify.pack(Kind.OUTPUT, 3, 10, 0, 0, 0, 3), AfdProtocolError, "not a attention peer"),
        (b"hello", AfdProtocolError, "not an afd data-plane message"),
        (notify.pack(Kind.HIDDEN, 3, 10, 0, 0, 0, 2), AfdProtocolError, "sent 2 rows .* says 3"),
    ]
    for msg, error, message in cases:
        fake.send(t, msg)
        with pytest.raises(error, match=message):
            t.recv_hidden(0, 0, timeout_s=5)
    fake.notice(t, layer=1, rows=3)
    batch = t.recv_hidden(1, 0, timeout_s=5)
    assert batch.hidden.shape == (3, 16) and batch.slices[0].rows == 3
    # A notification of the next step may arrive before its payload: it is kept, not refused.
    t.send_output(1, 0, np.zeros((3, 16), np.uint16))
    t.end_step()
    fake.notice(t, step=11, rows=1)
    time.sleep(0.1)
    t.flush()  # takes the early notification before the step begins
    t.begin_step(Step.of(11, [[0]]))
    assert t.recv_hidden(0, 0, timeout_s=5).slices[0].num_tokens == 0


def test_attention_refuses_output_of_unknown_step(pair) -> None:
    t, fake = pair("attention")
    t.begin_step(Step.of(5, [[1]]))
    t.send_hidden(0, 0, np.ones((1, 16), np.uint16))
    fake.notice(t, step=4, rows=1)
    with pytest.raises(AfdProtocolError, match="unknown step/layer, this rank is at step 5"):
        t.recv_outputs(0, 0, timeout_s=5)
    fake.notice(t, step=5, rows=1)
    assert len(t.recv_outputs(0, 0, timeout_s=5)) == 1


def test_missing_notification_is_peer_lost_within_bound(pair) -> None:
    t, _ = pair("ffn")
    t.begin_step(Step.of(1, [[1]]))
    started = time.monotonic()
    with pytest.raises(AfdPeerLost, match=r"^afd peer lost: attention rank 0 .*within 0.3 s"):
        t.recv_hidden(0, 0, timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    with pytest.raises(AfdPeerLost):  # unusable until reconnect
        t.begin_step(Step.of(2, [[1]]))


def test_peer_lost_event_interrupts_wait_and_reconnect_recovers(pair) -> None:
    t, fake = pair("ffn")
    t.begin_step(Step.of(1, [[1]]))
    assert not t.mark_peer_lost(Role.FFN, 0)  # not a peer of an FFN worker: ignored
    heard: list[str] = []  # what the GPU-driven exchange's watchdog registers (its wake)
    t.loss.listeners.append(lambda: heard.append(threading.current_thread().name))
    threading.Timer(0.2, t.mark_peer_lost, (Role.ATTENTION, 0, "keepalive failed")).start()
    started = time.monotonic()
    with pytest.raises(AfdPeerLost, match="^afd peer lost: attention rank 0 .*keepalive failed"):
        t.recv_hidden(0, 0, timeout_s=30)
    assert time.monotonic() - started < 2.0
    assert len(heard) == 1 and heard[0] != threading.current_thread().name  # once, on the Timer's
    with pytest.raises(AfdPeerLost):
        t.begin_step(Step.of(2, [[1]]))
    t.reconnect(4, [fake.spec()])
    t.begin_step(Step.of(1, [[1]], epoch=4))
    fake.notice(t, rows=1)
    assert t.recv_hidden(0, 0, timeout_s=5).hidden.shape == (1, 16)
