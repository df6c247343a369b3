"""The data plane's network surface (issue 39, should fix): each worker's UCX listens only on
the configured TCP port range (TransportConfig.tcp_port_range, AFD_DATA_TCP_PORT_RANGE), and
garbage sent to those listeners (random bytes, fake length words, connections reset at once,
connections left idle) while a 1:1 pair runs changes nothing: every step completes with every
byte checked on both sides, and both workers exit cleanly. Real NIXL agents in their own
processes (tests/data_plane_worker.py) and a real afd-ctl."""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import struct
import subprocess
import threading
import time

import pytest

from afd_data import Role, TransportConfig
from afd_data.config import parse_port_range
from afd_data.routing import peer_ranks
from tests.data_plane_worker import step_counts
from tests.test_data_plane import finish, spawn, stop_all, wait_event  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="`ss` (iproute2) is missing")


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        found.append((host.strip("[]"), int(port)))
    return found


def free_range(size: int = 24) -> str:
    """A port range nothing listens in now."""
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout
    used = {int(m) for m in re.findall(r":(\d+)\s", out)}
    for _ in range(100):
        low = random.randrange(42000, 48000)
        if not used & set(range(low, low + size)):
            return f"{low}-{low + size - 1}"
    raise AssertionError("no free port range found")


class Garbage(threading.Thread):
    """Sends junk to every listener until stopped; counts what it sent."""

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        super().__init__(daemon=True)
        self.targets = targets
        self.stop = threading.Event()
        self.sent = 0
        self.idle: list[socket.socket] = []

    def run(self) -> None:
        rng = random.Random(0)
        kinds = ("random", "length", "reset", "idle", "half")
        while not self.stop.is_set():
            for host, port in self.targets:
                kind = kinds[self.sent % len(kinds)]
                try:
                    s = socket.create_connection((host, port), timeout=2)
                    if kind == "random":
                        s.sendall(rng.randbytes(rng.choice((7, 512, 65536))))
                    elif kind == "length":  # a huge length word, then nothing more
                        s.sendall(struct.pack("<QQ", 2**63 - 1, 2**32) + b"\xff" * 48)
                    elif kind == "half":
                        s.sendall(rng.randbytes(100))
                        s.shutdown(socket.SHUT_WR)
                    if kind == "idle" and len(self.idle) < 32:
                        self.idle.append(s)
                    else:
                        if kind == "reset":
                            s.setsockopt(
                                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                            )
                        s.close()
                    self.sent += 1
                except OSError:
                    self.sent += 1  # refused or reset by the listener: also fine
            time.sleep(0.005)
        for s in self.idle:
            s.close()


@pytest.mark.timeout(300)
def test_listeners_stay_in_their_range_and_garbage_changes_nothing(spawn) -> None:  # noqa: F811
    port_range = free_range()
    low, high = parse_port_range(port_range) or (0, 0)
    config = {
        "hidden_size": 64,
        "max_tokens_per_peer": 24,
        "num_attention": 1,
        "num_ffn": 1,
        "tcp_port_range": port_range,
    }
    steps, layers, seed = 3000, 3, 7
    args = ["--steps", str(steps), "--layers", str(layers), "--seed", str(seed)]
    env_range = os.environ.pop("UCX_TCP_PORT_RANGE", None)  # the operator's would win
    try:
        ffn = spawn("ffn", 0, config, *args)
        attention = spawn("attention", 0, config, *args)
    finally:
        if env_range is not None:
            os.environ["UCX_TCP_PORT_RANGE"] = env_range
    for worker in (ffn, attention):
        wait_event(worker, "connected", 60)
    targets = []
    for worker in (ffn, attention):
        found = listeners(worker.pid)
        assert found, f"no TCP listener found for {worker.argv[2:6]}"
        outside = [p for _, p in found if not low <= p <= high]
        assert not outside, f"listening outside {port_range}: {found}"
        targets += found
    garbage = Garbage(targets)
    garbage.start()
    try:
        done = [finish(w, 240) for w in (ffn, attention)]
    finally:
        garbage.stop.set()
        garbage.join(10)
    assert garbage.sent >= 100, f"only {garbage.sent} junk connections while the pair ran"
    stop_all(spawn.daemon, [ffn, attention])
    cfg = TransportConfig(**config)
    fan_out = len(peer_ranks(Role.ATTENTION, 0, 1, 1, groups=cfg.ffn_groups))
    rows = sum(
        max(1, step_counts(seed, 1_000_000 + i, 1, 1, cfg.max_tokens_per_peer)[0][0])
        for i in range(steps)
    )
    expected = rows * fan_out * layers * cfg.hidden_size * cfg.itemsize
    assert [d["checked_bytes"] for d in done] == [expected, expected]


def test_the_port_range_is_checked() -> None:
    from afd_data import AfdBadInput

    for bad in ("41000", "41000-40000", "80-90", "a-b", "41000-70000"):
        with pytest.raises(AfdBadInput, match="tcp_port_range"):
            TransportConfig(hidden_size=8, max_tokens_per_peer=4, tcp_port_range=bad)
    assert TransportConfig(hidden_size=8, max_tokens_per_peer=4, tcp_port_range="0")
    env = {"AFD_DATA_TCP_PORT_RANGE": "45000-45099"}
    config = TransportConfig.from_env(env, hidden_size=8, max_tokens_per_peer=4)
    assert config.tcp_port_range == "45000-45099"
