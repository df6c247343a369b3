"""The attention worker's fence for `afd-ctl scale` (vllm_ext.attention.fence, issue 37) against a
real daemon: a busy worker fences between steps; an idle one has no next step to fence in, so
it says `fenced` at once and the change still completes; a step begun meanwhile waits for the
hold to lift. The attention worker is a ControllerClient driven by hand (the fence needs no
vLLM); the FFN workers are afd_ctl.sim_worker processes."""

from __future__ import annotations

import threading
from pathlib import Path

from afd_ctl.client import ControllerClient, WorkerSpec
from afd_ctl.sim_worker import make_payload
from afd_ctl.v1 import afd_pb2
from tests.netns import wait_until
from tests.procs import Proc, afd_ctl
from tests.test_control_elastic import sim, wait_status
from vllm_ext.attention.fence import ScaleFence


def test_idle_attention_worker_fences_at_once_and_a_busy_one_between_steps(
    start_daemon, procs: list[Proc], tmp_path: Path
) -> None:
    daemon = start_daemon("--fence-timeout-s", "20")
    sim(procs, tmp_path, daemon, "ffn", "f0")
    spec = WorkerSpec("a0", "ATTENTION", max_ffn=2, follows_scale=True)
    with ControllerClient(daemon.address, spec) as client:
        client.connect(30)
        first = client.wait_complete(30)
        fence = ScaleFence(client, "a0", 30)
        for step in (1, 2):  # two steps, then idle
            assert fence.before_step() is None  # no hold asked
            client.publish(make_payload(step, 1, 1))
            fence.published(step)
            client.flush(10)
            fence.step_closed()

        # Idle: the FENCE event fences it at once; the change completes with no step.
        out = afd_ctl(daemon.address, "scale", "--attention", "1", "--ffn", "2")
        assert out.returncode == 0, out.stderr
        sim(procs, tmp_path, daemon, "ffn", "f1", "--dp-rank", "1", "--dp-size", "2")
        done = wait_status(
            daemon, "1:2", lambda s: not s.HasField("change") and s.current.ffn == 2, 60
        )
        assert done.last_change.startswith("scaled from"), done.last_change
        assert fence.before_step() is None  # the hold is over: the next step runs at once
        assert client.view.epoch > first.epoch and len(client.view.peers) == 2
        client.publish(make_payload(3, 1, 1))
        fence.published(3)
        client.flush(10)
        fence.step_closed()

        # Busy: a step begun before the FENCE fences at its end; the next step waits for the
        # hold to lift and gets the new epoch's view.
        fence.before_step()
        client.publish(make_payload(4, 1, 1))
        fence.published(4)
        client.flush(10)
        out = afd_ctl(daemon.address, "scale", "--attention", "1", "--ffn", "1")
        assert out.returncode == 0, out.stderr
        wait_status(daemon, "the fence", lambda s: s.change.phase == afd_pb2.ScaleChange.FENCE, 30)
        # The daemon's status says FENCE a moment before this worker's session hears the hold:
        # step 4 closes once the worker knows it is asked to fence.
        wait_until(lambda: client.holding, 30, "the worker hears the hold")
        moved: list[object] = []
        waiter = threading.Thread(target=lambda: moved.append(fence.before_step()))
        fence.step_closed()  # step 4's outputs are back: fenced now
        waiter.start()
        waiter.join(30)
        # The next step gets the view that lifted the hold, or, when the change completed
        # before it began (the fence lifts ~30 ms after `fenced`), no hold and the new view
        # already in hand (what the session then follows, vllm_ext.attention.session._follow).
        assert moved, "the next step did not return from before_step"
        view = moved[0] if moved[0] is not None else client.view
        assert view.expected_ffn == 1, "the next step did not get the new epoch"  # type: ignore[attr-defined]
        done = wait_status(
            daemon, "1:1", lambda s: not s.HasField("change") and s.current.ffn == 1, 30
        )
        assert done.epoch_history[-1].reason.startswith("scaled to 1:1")
