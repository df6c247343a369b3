"""Elastic data planes (issue 37): real NIXL agents in their own processes
(tests/data_plane_worker.py --follow-scale) follow `afd-ctl scale` on a real daemon while the
attention side runs steps the whole time. The buffers are registered once, sized for
max_attention:max_ffn; each change only rewires the peers and the routing. Every byte of every
step is checked in whatever membership it ran in (hidden states on the FFN side, each FFN
rank's answer on the attention side), so a step routed to the wrong peer or into the wrong area
fails the worker; a worker the change leaves out is retired and exits 0.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from afd_data import AfdBadInput, Role, TransportConfig
from afd_data.layout import BufferLayout
from tests.procs import Proc, afd_ctl
from tests.test_control_elastic import status, wait_status
from tests.test_data_plane import start_worker, wait_event

SHAPE: dict[str, Any] = {"hidden_size": 64, "max_tokens_per_peer": 16, "dtype": "bfloat16"}
CAPACITY = {"max_attention": 2, "max_ffn": 2}


def events(proc: Proc, name: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in proc.log().splitlines()
        if line.startswith(f'{{"event": "{name}"')
    ]


def wait_connected(proc: Proc, peers: list[int], timeout_s: float = 60.0) -> dict[str, Any]:
    """The worker's 'connected' event with these peers (after a change), then a step in it."""
    pattern = rf'(?m)^\{{"event": "connected".*"peers": \[{", ".join(map(str, peers))}\]\}}$'
    event = json.loads(proc.wait_for(pattern, timeout_s).group(0))
    return event


def steps_after(proc: Proc, t: float, timeout_s: float = 60.0) -> None:
    """A 'step' event (every 25 steps) after time `t`: steps run in the new membership."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(e["t"] > t for e in events(proc, "step")):
        assert proc.popen.poll() is None, proc.tail()
        assert time.monotonic() < deadline, f"no step after the change:\n{proc.tail()}"
        time.sleep(0.05)


def scale(daemon: Any, attention: int, ffn: int, start=lambda: None, *flags: str) -> float:
    """`afd-ctl scale`, then the new workers; waits for the new epoch; returns its hold (s)."""
    out = afd_ctl(daemon.address, "scale", "--attention", str(attention), "--ffn", str(ffn), *flags)
    assert out.returncode == 0, out.stderr
    start()
    done = wait_status(
        daemon,
        f"the move to {attention}:{ffn}",
        lambda s: (
            not s.HasField("change") and (s.current.attention, s.current.ffn) == (attention, ffn)
        ),
        timeout=90,
    )
    assert done.last_change.startswith("scaled from"), done.last_change
    record = done.epoch_history[-1]
    assert record.epoch == done.epoch and record.reason.startswith(f"scaled to {attention}:{ffn}")
    return record.pause_s


def test_elastic_layout_is_sized_for_the_capacity_and_routes_per_view() -> None:
    fixed = TransportConfig(**SHAPE)
    elastic = TransportConfig(**SHAPE, **CAPACITY)
    assert BufferLayout(fixed, Role.ATTENTION).num_peers == 1
    assert BufferLayout(elastic, Role.ATTENTION).num_peers == 2
    assert BufferLayout(elastic, Role.FFN).num_peers == 2
    # The routing fields are each connect's; the capacity is what peers must agree on.
    assert "num_ffn" not in elastic.compared_shape_fields()
    assert elastic.compared_shape_fields()["max_ffn"] == 2
    moved = elastic.with_routing(1, 2, 1)
    assert (moved.num_ffn, moved.ffn_groups, moved.max_ffn) == (2, 1, 2)
    with pytest.raises(AfdBadInput, match="sized for at most 2:2"):
        elastic.with_routing(1, 3, 1)
    with pytest.raises(AfdBadInput, match="sized for exactly 1:1.*max_attention / max_ffn"):
        fixed.with_routing(1, 2, 1)
    with pytest.raises(AfdBadInput, match="num_ffn .3. is above max_ffn .2."):
        TransportConfig(**SHAPE, **CAPACITY, num_ffn=3)


@pytest.mark.timeout(300)
def test_ffn_scale_out_and_in_under_steps_bytes_intact(
    procs: list[Proc], tmp_path: Path, start_daemon
) -> None:
    """1:1 -> 1:2 (FFN rank 1 joins FFN rank 0's group: --expert-parallel-size 2) -> 1:1 while
    attention rank 0 runs steps: every output checked against each FFN rank's answer; FFN rank
    1 is retired and exits 0; the hold at each change is reported."""
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    one = {**SHAPE, **CAPACITY, "num_attention": 1, "num_ffn": 1}
    follow = ("--follow-scale", "--steps", "1000000", "--timeout", "30", "--layers", "3")
    until = tmp_path / "enough"

    def worker(role: str, rank: int, config: dict[str, Any], *extra: str) -> Proc:
        return start_worker(procs, tmp_path, daemon.address, role, rank, config, *follow, *extra)

    ffn0 = worker("ffn", 0, one)
    attention = worker("attention", 0, one, "--until-file", str(until))
    wait_event(attention, "step", 60)
    ffn1: list[Proc] = []

    def start_ffn1() -> None:
        two = {**one, "num_ffn": 2, "ffn_groups": 1}  # the target's membership
        ffn1.append(worker("ffn", 1, two))

    pauses = {}
    pauses["1:1->1:2"] = scale(daemon, 1, 2, start_ffn1, "--expert-parallel-size", "2")
    moved = wait_connected(attention, [0, 1])
    wait_connected(ffn0, [0])
    steps_after(attention, moved["t"])
    # FFN rank 1 ran steps, every byte checked; its own log line can trail the attention's.
    steps_after(ffn1[0], moved["t"])

    pauses["1:2->1:1"] = scale(daemon, 1, 1)
    assert ffn1[0].wait(30) == 0, ffn1[0].tail()
    assert "retired by afd-ctl" in events(ffn1[0], "stopped")[0]["reason"]
    back = [e for e in events(attention, "connected") if e.get("peers") == [0]]
    assert back, attention.tail()
    steps_after(attention, back[-1]["t"])
    print(
        "hold at each change (fence to new epoch):",
        {k: f"{v * 1e3:.0f} ms" for k, v in pauses.items()},
    )
    assert all(0 < p < 5 for p in pauses.values()), pauses

    until.touch()
    done = wait_event(attention, "done", 60)
    assert done["ok"] and done["steps"] > 50, done
    assert status(daemon).epoch_history[-1].reason.startswith("scaled to 1:1")
    daemon.signal(signal.SIGTERM)
    for proc in (attention, ffn0):
        assert proc.wait(30) == 0, proc.tail()
    assert events(ffn0, "done")[0]["ok"]
