"""Planned membership changes (issue 37) on the daemon's plain-Python state, without sockets:
`afd-ctl scale` from 1:1 to 2:1, 2:2, 1:2 and back to 1:1, what each worker is told, when
the epoch moves, what is refused and why."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from afd_ctl.config import DaemonConfig
from afd_ctl.controller import Controller
from afd_ctl.errors import ControlError
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sessions import Session
from afd_ctl.sim_worker import make_payload
from afd_ctl.topology import Topology
from afd_ctl.v1 import afd_pb2

Kind = afd_pb2.MembershipEvent.Kind


def run(scenario: Callable[[], object]) -> None:
    """The controller's mailboxes need an event loop."""

    async def main() -> None:
        scenario()

    asyncio.new_event_loop().run_until_complete(main())


def controller(m: int = 1, n: int = 1, **config: object) -> Controller:
    return Controller(DaemonConfig(expect_attention=m, expect_ffn=n, **config), first_epoch=100)  # type: ignore[arg-type]


def spec(worker_id: str, role: str, **fields: object) -> WorkerSpec:
    """A worker that follows planned changes, as afd_ctl.sim_worker's do."""
    return WorkerSpec(worker_id, role, follows_scale=True, **fields)  # type: ignore[arg-type]


def drain(session: Session) -> list[afd_pb2.SessionMessage]:
    """Everything queued for `session` since the last call (taken off its mailbox)."""
    out = list(session.mailbox._items)
    session.mailbox._items.clear()
    return out


def events(session: Session) -> list[afd_pb2.MembershipEvent]:
    return [m.event for m in drain(session) if m.WhichOneof("message") == "event"]


def payloads(session: Session) -> list[int]:
    return [m.payload.step_id for m in drain(session) if m.WhichOneof("message") == "payload"]


def publish(c: Controller, session: Session, step: int) -> None:
    payload = make_payload(step, c.membership.attention_dp_size, 1)
    payload.epoch = c.membership.epoch
    payload.sender_role_rank = session.worker.role_rank
    c.publish(session, payload)


def fenced(c: Controller, session: Session, last_step: int = 0) -> None:
    c.acknowledge(
        session,
        afd_pb2.SessionRequest(
            fenced=afd_pb2.Fenced(epoch=c.membership.epoch, last_step_id=last_step)
        ),
    )


def drained(c: Controller, session: Session) -> None:
    c.acknowledge(session, afd_pb2.SessionRequest(drained=afd_pb2.Drained(reason="idle")))


def test_one_to_one_through_two_to_one_two_to_two_one_to_two_and_back():
    def scenario() -> None:
        c = controller()
        m = c.membership
        a0 = c.open_session(spec("a0", ATTENTION), "p")
        f0 = c.open_session(spec("f0", FFN), "p")
        assert c.health == "SERVING" and m.epoch == 102
        publish(c, a0, 1)
        assert payloads(f0) == [1]

        # 1:1 -> 2:1: the serving pair goes on while attention rank 1 registers (pending).
        assert "waiting for attention rank 1 to register" in c.scale(2, 1, 0, "more load")
        assert [e.kind for e in events(f0)][-1] == Kind.TARGET_SET
        a1 = c.open_session(spec("a1", ATTENTION, dp_rank=1, dp_size=2), "p")
        pending = c.view_for(a1.worker)
        assert pending.pending and not pending.complete and not pending.peers
        assert m.epoch == 102, "a pending worker moves no epoch"
        # Every target slot is held: attention workers hold between steps (FENCE).
        assert c.view_for(a0.worker).hold and m.epoch == 102
        publish(c, a0, 2)  # a step begun before it saw the hold still goes through
        assert payloads(f0) == [2]
        fenced(c, a0, last_step=2)
        assert m.topology == Topology(2, 1, 1) and m.epoch == 103
        scaled = events(f0)[-1]
        assert scaled.kind == Kind.SCALED and not scaled.view.hold and scaled.view.complete
        assert [p.worker.worker_id for p in scaled.view.peers] == ["a0", "a1"]
        assert events(a1)[-1].view.complete
        assert c.status().epoch_history[-1].reason == "scaled to 2:1 (1 ffn group of 1)"
        publish(c, a0, 3)  # DP metadata of two attention ranks now
        assert payloads(f0) == [3]

        # 2:1 -> 2:2 (one more FFN group): attention rank 1 becomes the second sender.
        c.scale(2, 2, 0, "experts hot")
        f1 = c.open_session(spec("f1", FFN, dp_rank=1, dp_size=2), "p")
        assert c.scaling.holding and m.epoch == 103
        fenced(c, a0, last_step=3)
        assert c.scaling.holding, "every routed attention worker holds, the non-sender too"
        fenced(c, a1)
        assert m.topology == Topology(2, 2, 2) and m.epoch == 104
        assert m.routes() == [(0, [0]), (1, [1])] and m.sender_ranks() == [0, 1]
        publish(c, a1, 1)
        assert payloads(f1) == [1] and payloads(f0) == []

        # 2:2 -> 1:2: attention rank 1 drains first; the two FFN ranks become one group of 2.
        c.scale(1, 2, 0, "night")
        assert c.view_for(a1.worker).leaving and not c.view_for(a0.worker).leaving
        assert c.status().change.waiting_for == ["attention rank 1 (a1) to drain its requests"]
        publish(c, a1, 2)  # it finishes what it has in flight
        drained(c, a1)
        assert c.scaling.holding
        fenced(c, a0, 3)
        fenced(c, a1, 2)
        assert m.topology == Topology(1, 2, 1) and m.epoch == 105
        retired = events(a1)[-1]
        assert retired.kind == Kind.RETIRED and a1.ended and a1.mailbox.closed
        assert "a1" not in c.sessions and m.find("a1") is None and m.losses == 0
        assert [p.worker.worker_id for p in c.view_for(a0.worker).peers] == ["f0", "f1"]
        publish(c, a0, 4)
        assert payloads(f0) == [4] and payloads(f1) == [2, 4]

        # 1:2 -> 1:1: FFN rank 1 keeps serving its steps until the fence, then is retired.
        c.scale(1, 1, 0, "quiet")
        assert c.view_for(f1.worker).leaving and c.scaling.holding
        publish(c, a0, 5)
        fenced(c, a0, 5)
        assert m.topology == Topology(1, 1, 1) and m.epoch == 106
        # Its last step, then RETIRED, in that order on its stream.
        assert [m.WhichOneof("message") for m in drain(f1)][-2:] == ["payload", "event"]
        assert c.health == "SERVING"
        history = [
            (r.epoch, r.topology.attention, r.topology.ffn) for r in c.status().epoch_history
        ]
        assert history[-4:] == [(103, 2, 1), (104, 2, 2), (105, 1, 2), (106, 1, 1)]
        assert c.scaling.outcomes == {"scaled": 4, "aborted": 0, "cancelled": 0}

    run(scenario)


@pytest.mark.parametrize(
    ("m", "n", "e", "rule"),
    [
        (2, 4, 3, r"expert-parallel size 3 does not divide the 4 FFN workers \(rule: E divides N"),
        (1, 4, 2, r"make 2 groups for 1 attention worker\(s\) \(rule: FFN groups N / E must not"),
        (0, 1, 0, r"leaves a role without workers \(rule: at least one attention and one FFN"),
        (9999, 1, 0, r"more than 4096 workers of a role"),
    ],
)
def test_bad_targets_are_refused_in_one_line_naming_the_rule(m: int, n: int, e: int, rule: str):
    def scenario() -> None:
        c = controller()
        epoch = c.membership.epoch
        with pytest.raises(ControlError, match=rule) as caught:
            c.scale(m, n, e, "typo")
        assert caught.value.code == "INVALID_ARGUMENT" and "\n" not in caught.value.message
        assert c.membership.target is None and c.membership.epoch == epoch

    run(scenario)


def test_a_target_a_registered_worker_cannot_follow_is_refused_naming_it():
    def scenario() -> None:
        c = controller()
        c.open_session(spec("a0", ATTENTION, max_attention=1, max_ffn=2), "p")
        c.open_session(spec("t0", FFN), "p")
        with pytest.raises(ControlError, match="attention rank 0 \\(a0\\) cannot follow 2:1"):
            c.scale(2, 1, 0, "x")
        assert "moving to 1:2" in c.scale(1, 2, 0, "fits")
        # A worker that does not follow planned changes (a vLLM worker of a fixed size): refused up
        # front, naming it, instead of a fence that would time out.
        plain = controller()
        plain.open_session(WorkerSpec("v0", ATTENTION), "p")
        with pytest.raises(ControlError, match=r"attention rank 0 \(v0\) cannot follow a planned"):
            plain.scale(2, 1, 0, "x")
        assert plain.membership.target is None
        tp = controller(2, 1)
        tp.open_session(spec("a0", ATTENTION, tp_rank=0, tp_size=2), "p")
        with pytest.raises(ControlError, match="rule: M is a multiple of the attention TP size"):
            tp.scale(3, 1, 0, "x")

    run(scenario)


def test_attention_servers_that_step_alone_get_an_ffn_group_each():
    """Independent attention servers (`vllm serve --afd-role attention` of DP size 1: lockstep
    size 1) cannot share an FFN group, which waits for each of its attention ranks every step:
    a scale to 2:1 is refused naming the rule (2:2, a group each, is taken), and so is such a
    server registering into a 2:1 set. One DP=2 server's ranks (lockstep 2) share a group."""
    from afd_ctl.routing import lockstep_conflict

    assert lockstep_conflict(2, 1, 1) == (0, 1) and lockstep_conflict(2, 2, 1) is None
    assert lockstep_conflict(2, 1, 2) is None and lockstep_conflict(4, 2, 2) == (0, 2)
    assert lockstep_conflict(3, 1, 0) is None  # 0: every rank steps with every other

    def scenario() -> None:
        c = controller()
        c.open_session(spec("a0", ATTENTION, lockstep_size=1, max_attention=2, max_ffn=2), "p")
        c.open_session(spec("f0", FFN, max_attention=2, max_ffn=2), "p")
        with pytest.raises(
            ControlError, match="rule: attention ranks that share an FFN group"
        ) as e:
            c.scale(2, 1, 0, "more load")
        assert e.value.code == "INVALID_ARGUMENT" and "\n" not in e.value.message
        assert "2:1 (1 ffn group of 1) makes attention ranks 0 and 1 share" in e.value.message
        assert "--ffn 2 with --expert-parallel-size 1" in e.value.message
        assert c.membership.target is None
        assert "moving to 2:2" in c.scale(2, 2, 0, "a group each")

        shared = controller(2, 1)
        with pytest.raises(ControlError, match="cannot register: 2:1") as e:
            shared.open_session(spec("b1", ATTENTION, dp_rank=1, dp_size=2, lockstep_size=1), "p")
        assert e.value.code == "FAILED_PRECONDITION"
        dp2 = controller(2, 1)
        for rank in (0, 1):  # one `vllm serve --data-parallel-size 2`
            dp2.open_session(
                spec(f"d{rank}", ATTENTION, dp_rank=rank, dp_size=2, lockstep_size=2), "p"
            )
        dp2.open_session(spec("g0", FFN), "p")
        assert dp2.health == "SERVING"

    run(scenario)


def test_a_worker_that_followed_a_change_registers_again_by_its_rank():
    """A worker registered at 1:1 (its dp_size 1) that followed a scale to 2:2 registers again
    (a rejoin after a loss only its data plane saw, or a restarted daemon told the new size):
    its rank is checked, not the size it started with. One beyond the membership is refused."""

    def scenario() -> None:
        c = controller(2, 2)
        c.open_session(spec("a1", ATTENTION, dp_rank=1, dp_size=2, lockstep_size=1), "p")
        c.open_session(spec("f0", FFN, dp_rank=0, dp_size=2), "p")
        c.open_session(spec("f1", FFN, dp_rank=1, dp_size=2), "p")
        c.open_session(spec("a0", ATTENTION, lockstep_size=1), "p")  # started at 1:1
        assert c.health == "SERVING"
        with pytest.raises(ControlError, match="attention rank 2 is not below the 2"):
            c.open_session(spec("a2", ATTENTION, dp_rank=2, dp_size=3, lockstep_size=1), "p")

    run(scenario)


def test_one_change_at_a_time_a_scale_back_cancels_and_a_fence_that_stalls_is_given_up():
    def scenario() -> None:
        c = controller(fence_timeout_s=2.0)
        m = c.membership
        a0 = c.open_session(spec("a0", ATTENTION), "p")
        c.open_session(spec("f0", FFN), "p")
        c.scale(1, 2, 0, "first")
        with pytest.raises(ControlError, match="a change to 1:2 .* is in progress") as caught:
            c.scale(2, 2, 0, "second")
        assert caught.value.code == "FAILED_PRECONDITION"
        assert "already moving to 1:2" in c.scale(1, 2, 0, "again")
        assert "cancelled" in c.scale(1, 1, 0, "never mind")
        assert m.target is None and c.status().last_change.startswith("cancelled")

        # A fence no attention worker holds is given up after --fence-timeout-s.
        c.scale(1, 2, 0, "again")
        f1 = c.open_session(spec("f1", FFN, dp_rank=1, dp_size=2), "p")
        assert c.scaling.holding
        with pytest.raises(ControlError, match="in progress \\(fence"):
            c.scale(1, 1, 0, "too late to cancel")
        assert c.scaling.change is not None
        c.scaling.change.fence_mono -= 3.0  # the bound has passed (no sleep)
        c.scaling.tick()
        assert m.target is None and m.topology == Topology(1, 1, 1) and not c.scaling.holding
        last = c.status().last_change
        assert "attention rank 0 (a0) did not hold within 2 s" in last
        aborted = events(a0)[-1]
        assert aborted.kind == Kind.CHANGE_ABORTED and not aborted.view.hold
        assert c.view_for(f1.worker).pending and c.health == "SERVING"

    run(scenario)


def test_a_fence_ack_that_overtakes_the_last_payload_waits_for_it():
    """`fenced` comes on the Session, payloads on the Publish stream: the epoch moves only once
    the step the attention worker says it published last has been relayed."""

    def scenario() -> None:
        c = controller()
        a0 = c.open_session(spec("a0", ATTENTION), "p")
        f0 = c.open_session(spec("f0", FFN), "p")
        publish(c, a0, 1)
        c.scale(1, 2, 0, "x")
        c.open_session(spec("f1", FFN, dp_rank=1, dp_size=2), "p")
        fenced(c, a0, last_step=2)
        assert c.scaling.holding, "step 2 has not arrived yet"
        publish(c, a0, 2)
        assert not c.scaling.holding and c.membership.topology == Topology(1, 2, 1)
        assert payloads(f0) == [1, 2]

    run(scenario)


def test_a_loss_during_a_change_stays_a_loss_and_the_change_goes_on():
    def scenario() -> None:
        c = controller()
        m = c.membership
        a0 = c.open_session(spec("a0", ATTENTION), "p")
        c.open_session(spec("f0", FFN), "p")
        c.scale(2, 1, 0, "x")
        a1 = c.open_session(spec("a1", ATTENTION, dp_rank=1, dp_size=2), "p")
        assert c.scaling.holding
        # A pending worker that dies costs the serving set nothing: no epoch, no PEER_LOST.
        c.close_session(a1, "killed")
        assert m.epoch == 102 and m.losses == 0 and not c.scaling.holding
        assert [e.kind for e in events(a0)][-1] == Kind.TARGET_SET  # fence restarted
        a1 = c.open_session(spec("a1", ATTENTION, dp_rank=1, dp_size=2), "p")
        assert c.scaling.holding
        # An unplanned loss while fencing: PEER_LOST as today, the fence starts over once the
        # set is whole again.
        f0 = next(s for s in c.sessions.values() if s.worker.worker_id == "f0")
        c.close_session(f0, "killed")
        assert m.losses == 1 and c.health == "NOT_SERVING" and not c.scaling.holding
        assert Kind.PEER_LOST in [e.kind for e in events(a0)]
        assert c.status().change.waiting_for == ["ffn rank 0 to register"]
        c.open_session(spec("f0", FFN), "p")
        fenced(c, a0)
        assert m.topology == Topology(2, 1, 1) and c.health == "SERVING"

    run(scenario)


def test_status_and_views_show_target_and_history():
    def scenario() -> None:
        c = controller()
        a0 = c.open_session(spec("a0", ATTENTION), "p")
        c.open_session(spec("f0", FFN), "p")
        c.scale(1, 2, 2, "ep")
        status = c.status()
        assert status.current == afd_pb2.Topology(attention=1, ffn=1, ffn_groups=1)
        assert status.change.target == afd_pb2.Topology(attention=1, ffn=2, ffn_groups=1)
        assert status.change.phase == afd_pb2.ScaleChange.GATHER
        view = c.view_for(a0.worker)
        assert view.target.ffn == 2 and not view.hold and not view.pending
        assert [r.reason for r in status.epoch_history][0] == "daemon started"
        assert "registered" in status.epoch_history[-1].reason

    run(scenario)
