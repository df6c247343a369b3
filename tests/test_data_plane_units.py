"""The data plane's pure pieces on their own: the inbox of notifications and the credit rules.

No NIXL agent and no process here: the inbox takes notifications as the bytes a peer's WRITE
carries (``afd_data.notify.pack``), and the credit rules are plain functions over a Credits
value. The last test builds one real transport to check that ``NixlTransport(...)`` takes the
endpoint of its role.
"""

from __future__ import annotations

import logging
import os

import pytest

from afd_data import credits, notify
from afd_data.credits import Credits
from afd_data.errors import AfdBadInput, AfdProtocolError, AfdStaleEpoch
from afd_data.inbox import Inbox
from afd_data.notify import Kind, Notice
from afd_data.routing import Role

# An FFN worker (rank 0) whose attention peers are ranks 0 and 2 (agents "a0", "a2").
SENDERS = {"a0": 0, "a2": 2}
LABELS = ["attention rank 0 (agent a0)", "attention rank 2 (agent a2)"]


def hidden(epoch: int, step: int, layer: int = 0, stage: int = 0, src: int = 0, rows: int = 1):
    return notify.pack(Kind.HIDDEN, epoch, step, layer, stage, src, rows)


def ffn_inbox(cap: int = 8, screen=None) -> Inbox:
    return Inbox("ffn-unit", Role.FFN, 0, 2, Kind.HIDDEN, cap, screen or (lambda n: None))


# ---------------------------------------------------------------------------- inbox


def test_inbox_keeps_newer_epochs_drops_left_ones_refuses_unknown(caplog) -> None:
    inbox = ffn_inbox()
    inbox.absorb("a0", hidden(epoch=3, step=1))  # before the first connect: kept aside
    assert inbox.arrived == {} and len(inbox.future) == 1
    inbox.enter_epoch(3, SENDERS, LABELS)
    assert inbox.arrived == {(1, 0, 0, 0): 1} and inbox.future == []

    inbox.absorb("a2", hidden(epoch=5, step=1, src=2))  # a peer that reconnected first
    assert len(inbox.future) == 1
    inbox.enter_epoch(5, SENDERS, LABELS)
    assert inbox.arrived == {(1, 0, 0, 2): 1} and inbox.past_epochs == {3}

    with caplog.at_level(logging.INFO, logger="afd_data.inbox"):
        inbox.absorb("a0", hidden(epoch=3, step=2))  # late traffic of an epoch it left
    assert "dropped late hidden notification epoch 3" in caplog.text
    with pytest.raises(AfdStaleEpoch, match="epoch 4, which this transport never joined"):
        inbox.absorb("a0", hidden(epoch=4, step=2))
    assert inbox.arrived == {(1, 0, 0, 2): 1}


def test_inbox_refuses_strangers_wrong_kind_stage_duplicates_and_overflow() -> None:
    inbox = ffn_inbox(cap=3)
    inbox.enter_epoch(3, SENDERS, LABELS)
    inbox.absorb("a0", notify.pack(Kind.PROBE, 3, 0, 0, 0, 0, 0))  # probes are ignored
    cases = [
        ("x9", hidden(3, 1), "not a attention peer of ffn rank 0 in epoch 3"),
        ("a0", hidden(3, 1, src=2), "not a attention peer"),  # agent a0 is rank 0, not 2
        ("a0", notify.pack(Kind.OUTPUT, 3, 1, 0, 0, 0, 1), "not a attention peer"),
        ("a0", hidden(3, 1, stage=2), "stage 2 but num_stages is 2"),
        ("a0", b"hello", "not an afd data-plane message"),
    ]
    for agent, msg, message in cases:
        with pytest.raises(AfdProtocolError, match=message):
            inbox.absorb(agent, msg)
    inbox.absorb("a0", hidden(3, 1))
    with pytest.raises(AfdProtocolError, match="duplicate"):
        inbox.absorb("a0", hidden(3, 1))
    inbox.absorb("a0", hidden(3, 1, layer=1))
    inbox.absorb("a0", hidden(3, 1, layer=2))
    with pytest.raises(AfdProtocolError, match="more than 3 notifications waiting"):
        inbox.absorb("a0", hidden(3, 1, layer=3))
    assert len(inbox.arrived) == 3


def test_inbox_files_the_rest_then_raises_the_first_refusal() -> None:
    refused: list[Notice] = []

    def screen(n: Notice) -> None:
        if n.step < 2:
            refused.append(n)
            raise AfdProtocolError(f"{n.describe()}: unknown step")

    inbox = ffn_inbox(screen=screen)
    inbox.enter_epoch(3, SENDERS, LABELS)
    with pytest.raises(AfdProtocolError, match="unknown step"):
        inbox.absorb_all({"a0": [hidden(3, 1), hidden(3, 2)], "a2": [hidden(3, 2, src=2)]})
    assert [n.step for n in refused] == [1]
    assert set(inbox.arrived) == {(2, 0, 0, 0), (2, 0, 0, 2)}


def test_inbox_purge_and_take_check_rows() -> None:
    inbox = ffn_inbox()
    inbox.enter_epoch(3, SENDERS, LABELS)
    for msg in (hidden(3, 1), hidden(3, 2, rows=2), hidden(3, 2, src=2, rows=1)):
        inbox.absorb("a0" if notify.unpack(msg, "?").src_rank == 0 else "a2", msg)
    assert inbox.purge_before(2) == 1  # step 1 was never taken
    keys = [(2, 0, 0, 0), (2, 0, 0, 2)]
    assert inbox.complete(keys) and not inbox.complete([(2, 1, 0, 0)])
    with pytest.raises(AfdProtocolError, match=r"attention rank 2 sent 1 rows .* says 3"):
        inbox.take(keys, {0: 2, 2: 3}, [2, 0, 3], "hidden states")
    assert inbox.arrived == {}  # taken, right or wrong
    inbox.leave_epoch()
    assert inbox.epoch is None and inbox.past_epochs == {3}


# ---------------------------------------------------------------------------- credit rules


def test_attention_credits() -> None:
    c = Credits.empty(2)
    credits.check_next_step(c, 5, epoch=3)
    credits.begin_step(c, 5)
    credits.check_send_hidden(c, slot=0, layer=0, stage=0, layers_in_flight=1)
    credits.hidden_sent(c, slot=0, layer=0, stage=0)
    with pytest.raises(AfdBadInput, match=r"overwrite .* call recv_outputs\(layer=0, stage=0\)"):
        credits.check_send_hidden(c, slot=0, layer=1, stage=0, layers_in_flight=1)
    with pytest.raises(AfdBadInput, match="no hidden states of that layer"):
        credits.check_recv_outputs(c, slot=1, layer=0, stage=1)
    with pytest.raises(AfdBadInput, match=r"end_step\(\) while step 5 .* recv_outputs\(layer=0"):
        credits.check_step_finished(c, "end_step()", "recv_outputs")

    # An output answers only an outstanding layer of the current step.
    credits.check_output_notice(c, Notice(Kind.OUTPUT, 3, 5, 0, 0, 0, 1), slot=0)
    with pytest.raises(AfdProtocolError, match="unknown step/layer, this rank is at step 5"):
        credits.check_output_notice(c, Notice(Kind.OUTPUT, 3, 4, 0, 0, 0, 1), slot=0)

    credits.check_recv_outputs(c, slot=0, layer=0, stage=0)
    credits.outputs_taken(c, slot=0, layer=0, stage=0)
    credits.check_step_finished(c, "end_step()", "recv_outputs")
    credits.check_send_hidden(c, slot=0, layer=1, stage=0, layers_in_flight=1)  # freed
    credits.hidden_sent(c, slot=0, layer=1, stage=0)
    with pytest.raises(AfdBadInput, match="layers must increase"):
        credits.check_send_hidden(c, slot=0, layer=1, stage=0, layers_in_flight=1)
    with pytest.raises(AfdBadInput, match="does not increase"):
        credits.check_next_step(c, 5, epoch=3)

    credits.reset(c)  # a membership change forgets the step and its ids
    assert (c.step, c.last_step, c.outstanding, c.last_layer) == (None, None, [{}, {}], [-1, -1])
    credits.check_next_step(c, 1, epoch=4)
    with pytest.raises(AfdBadInput, match="integer >= 0"):
        credits.check_next_step(c, -1, epoch=4)


def test_ffn_credits() -> None:
    c = Credits.empty(1)
    # Before the first step, hidden states of any step are kept.
    credits.check_hidden_notice(c, Notice(Kind.HIDDEN, 3, 7, 0, 0, 0, 1))
    credits.begin_step(c, 7)
    with pytest.raises(AfdBadInput, match="not received in step 7; call recv_hidden first"):
        credits.check_send_output(c, slot=0, layer=0, stage=0)
    credits.check_recv_hidden(c, slot=0, layer=0, stage=0)
    credits.hidden_taken(c, slot=0, layer=0, stage=0)
    with pytest.raises(AfdBadInput, match=r"slot still holds layer 0; call send_output"):
        credits.check_recv_hidden(c, slot=0, layer=2, stage=0)
    with pytest.raises(AfdBadInput, match=r"begin_step\(8\) while step 7 .* send_output"):
        credits.check_step_finished(c, "begin_step(8)", "send_output")
    credits.check_send_output(c, slot=0, layer=0, stage=0)
    credits.output_sent(c, slot=0, stage=0)
    with pytest.raises(AfdBadInput, match="twice in step 7"):
        credits.check_recv_hidden(c, slot=1, layer=0, stage=0)

    with pytest.raises(AfdProtocolError, match="at step 7 and already took layer 0"):
        credits.check_hidden_notice(c, Notice(Kind.HIDDEN, 3, 7, 0, 0, 0, 1))
    with pytest.raises(AfdProtocolError, match="unknown step, this rank is at step 7;"):
        credits.check_hidden_notice(c, Notice(Kind.HIDDEN, 3, 6, 5, 0, 0, 1))
    credits.check_hidden_notice(c, Notice(Kind.HIDDEN, 3, 7, 1, 0, 0, 1))
    credits.check_hidden_notice(c, Notice(Kind.HIDDEN, 3, 8, 0, 0, 0, 1))  # next step: early

    credits.begin_step(c, 8)
    assert c.done == [set()] and c.step == 8


# ---------------------------------------------------------------------------- endpoints


def test_transport_takes_the_endpoint_of_its_role() -> None:
    """One real NIXL agent per role (nothing connected): the role picks the endpoint once."""
    from afd_data import NixlTransport, TransportConfig
    from afd_data.endpoints import AttentionEndpoint, FfnEndpoint

    cfg = TransportConfig(hidden_size=16, max_tokens_per_peer=4)
    for role, cls, foreign in (
        ("attention", AttentionEndpoint, "recv_hidden"),
        ("ffn", FfnEndpoint, "send_hidden"),
    ):
        with NixlTransport(f"unit-{role}-{os.getpid()}", role, 0, cfg) as t:
            assert type(t._endpoint) is cls
            with pytest.raises(AfdBadInput, match=f"{foreign}\\(\\) is for .* this is {role}"):
                getattr(t, foreign)(0, 0, None)


# ---------------------------------------------------------------------------- FFN groups


def test_config_resolves_and_checks_the_ffn_groups() -> None:
    from afd_data import TransportConfig

    base = {"hidden_size": 8, "max_tokens_per_peer": 2, "num_attention": 2, "num_ffn": 4}
    assert TransportConfig(**base).ffn_groups == 2  # 0: min(M, N), today's default
    assert TransportConfig(**base, ffn_groups=1).shape_fields()["ffn_groups"] == 1
    env = {"AFD_DATA_FFN_GROUPS": "1"}
    assert TransportConfig.from_env(env, **base).ffn_groups == 1
    assert TransportConfig.from_env(env, **base, ffn_groups=2).ffn_groups == 2  # flags win
    for bad in (3, -1):
        with pytest.raises(AfdBadInput, match=r"TransportConfig.ffn_groups: .* must be in 1..2"):
            TransportConfig(**base, ffn_groups=bad)


def test_step_plan_of_one_group_two_to_two() -> None:
    """2:2 in one group (expert-parallel size 2): each attention rank writes its rows to both FFN
    ranks, after the rows of attention rank 0; each FFN rank packs both attention ranks."""
    from afd_data import TransportConfig
    from afd_data.step_plan import PeerSlice, plan_step

    cfg = TransportConfig(
        hidden_size=8, max_tokens_per_peer=8, num_attention=2, num_ffn=2, ffn_groups=1
    )
    counts = [[3, 5]]
    for a, rows, offset in ((0, 3, 0), (1, 5, 3)):
        plan = plan_step(cfg, Role.ATTENTION, a, counts)
        assert (plan.my_rows, plan.offsets) == ([rows], [[offset, offset]])
        assert plan.rows_by_rank == [{0: rows, 1: rows}]
    for f in (0, 1):
        plan = plan_step(cfg, Role.FFN, f, counts)
        assert plan.slices[0] == (PeerSlice(0, 0, 0, 3, 3), PeerSlice(1, 1, 3, 5, 5))
        assert plan.total_rows == [8] and plan.rows_by_rank == [{0: 3, 1: 5}]
    # The default grouping of 2:2 is two 1:1 pairs.
    pairs = TransportConfig(hidden_size=8, max_tokens_per_peer=8, num_attention=2, num_ffn=2)
    assert plan_step(pairs, Role.ATTENTION, 1, counts).offsets == [[0]]
    assert plan_step(pairs, Role.FFN, 1, counts).slices[0] == (PeerSlice(1, 1, 0, 5, 5),)


def test_layout_and_blob_carry_the_ffn_groups() -> None:
    from afd_data import TransportConfig
    from afd_data.blob import PeerBlob, decode_blob, encode_blob, shape_mismatches
    from afd_data.layout import BufferLayout
    from afd_data.v1 import blob_pb2

    one = TransportConfig(hidden_size=8, max_tokens_per_peer=2, num_attention=2, num_ffn=2)
    one = TransportConfig(**{**one.shape_fields(), "ffn_groups": 1})
    pairs = TransportConfig(**{**one.shape_fields(), "ffn_groups": 2})
    # An attention rank of one group receives an output from both FFN ranks.
    assert BufferLayout(one, Role.ATTENTION).num_peers == 2
    assert BufferLayout(pairs, Role.ATTENTION).num_peers == 1
    blob = PeerBlob("a", b"md", Role.FFN, 1, "DRAM", 4096, 1024, 0, one.shape_fields())
    assert decode_blob(encode_blob(blob)).shape["ffn_groups"] == 1
    (diff,) = shape_mismatches(pairs.shape_fields(), one.shape_fields())
    assert diff.startswith("ffn_groups: this worker 2, peer 1") and "--expert-parallel-size" in diff
    # A worker older than the field sends 0: it routes with the default, min(M, N).
    old = blob_pb2.DataPlaneBlob()
    old.ParseFromString(encode_blob(blob))
    old.shape.ffn_groups = 0
    assert decode_blob(old.SerializeToString()).shape["ffn_groups"] == 2


def test_a_loss_tells_its_listeners_once_per_epoch() -> None:
    """The GPU-driven exchange's watchdog hears a loss when it is recorded (not at its next
    round), whichever thread records it; a second loss of the same epoch tells nobody."""
    from types import SimpleNamespace

    from afd_data.loss import Loss

    heard: list[str] = []
    loss = Loss("t", SimpleNamespace(epoch=3), SimpleNamespace(step=7))  # type: ignore[arg-type]
    loss.listeners.append(lambda: heard.append("first"))
    loss.listeners.append(lambda: 1 / 0)  # a broken listener hides nothing
    loss.report("ffn:0", "ffn rank 0 was reported lost")
    loss.report("ffn:1", "ffn rank 1 was reported lost")
    assert heard == ["first"] and loss.lost is not None and "rank 0" in str(loss.lost)
    loss.lost = None  # a reconnect (NixlTransport.connect) starts a new epoch
    loss.report("ffn:1", "ffn rank 1 was reported lost")
    assert heard == ["first", "first"]


def test_a_waiter_that_was_itself_stopped_does_not_blame_its_peer() -> None:
    """A bound counts only time the waiter polled: frozen for 1.2 s (a SIGSTOP, say; a clock
    here) inside a 0.5 s wait, it still takes the answer that arrived meanwhile; a peer that
    never answers is still lost, after the bound plus the stall; stalls move a deadline on by
    10 s at most."""
    from types import SimpleNamespace

    from afd_data.config import TransportConfig
    from afd_data.errors import AfdPeerLost
    from afd_data.poller import MAX_STALL_CREDIT_S, Poller

    def waited(stalls: list[float], answer_after: int | None) -> tuple[bool, float]:
        """(answered, waited s on the clock): each poll advances the clock 1 ms plus the
        next stall; the answer is there from poll `answer_after` on."""
        now = [0.0]
        polls = [0]

        def clock() -> float:
            return now[0]

        def poll() -> dict:
            polls[0] += 1
            now[0] += 0.001 + (stalls.pop(0) if stalls else 0.0)
            return {}

        agent = SimpleNamespace(get_new_notifs=poll)
        poller = Poller(
            "unit", agent, TransportConfig(8, 8, poll_spin_us=1e9, probe_interval_s=1e9), 0,
            SimpleNamespace(absorb_all=None), SimpleNamespace(inflight=[]),  # type: ignore[arg-type]
            SimpleNamespace(lost=None), clock,  # type: ignore[arg-type]
        )  # fmt: skip

        def lost() -> AfdPeerLost:
            return AfdPeerLost("the peer sent nothing within 0.5 s")

        try:
            poller.wait(lambda: answer_after is not None and polls[0] >= answer_after, 0.5, lost,
                        lambda: [])  # fmt: skip
        except AfdPeerLost:
            return False, now[0]
        return True, now[0]

    # Frozen 1.2 s at the 100th poll; the answer is there at the next poll.
    assert waited([0.0] * 99 + [1.2], 101)[0]
    # The peer never answers: lost once the bound has passed outside the stall.
    answered, at = waited([0.0] * 99 + [1.2], None)
    assert not answered and 1.7 <= at < 1.8
    # A waiter that stalls on every poll still gives up: 0.5 s plus the whole credit.
    answered, at = waited([0.3] * 1000, None)
    assert not answered and 0.5 + MAX_STALL_CREDIT_S <= at <= 0.5 + MAX_STALL_CREDIT_S + 0.31
    # Gaps of up to 50 ms between polls are polling, not a stall: no credit.
    answered, at = waited([0.04] * 1000, None)
    assert not answered and 0.5 <= at < 0.55


def test_peers_must_meet_their_gpu_flags_alike() -> None:
    """The GPU-driven hop's flags follow num_layers and gpu_flag_resets (gpu_protocol.flag_use):
    a peer that differs in either would never meet them, so the blob carries both and the
    connect refuses the difference, saying where each comes from; a worker older than the
    fields (0, "") reads as one that wrote every flag back."""
    from afd_data import TransportConfig
    from afd_data.blob import PeerBlob, decode_blob, encode_blob, shape_mismatches
    from afd_data.v1 import blob_pb2

    mine = TransportConfig(hidden_size=8, max_tokens_per_peer=2, num_layers=61)
    blob = PeerBlob("a", b"md", Role.FFN, 0, "DRAM", 4096, 1024, 0, mine.shape_fields())
    assert decode_blob(encode_blob(blob)).shape["num_layers"] == 61
    theirs = TransportConfig(**{**mine.shape_fields(), "gpu_flag_resets": "each"})
    (diff,) = shape_mismatches(mine.shape_fields(), theirs.shape_fields())
    assert diff.startswith("gpu_flag_resets: this worker 'auto', peer 'each'")
    assert "AFD_DATA_GPU_FLAG_RESETS" in diff
    old = blob_pb2.DataPlaneBlob()
    old.ParseFromString(encode_blob(blob))
    old.shape.num_layers, old.shape.gpu_flag_resets = 0, ""
    older = decode_blob(old.SerializeToString()).shape
    assert (older["num_layers"], older["gpu_flag_resets"]) == (0, "each")
    diffs = shape_mismatches(mine.shape_fields(), older)
    assert [d.split(":")[0] for d in diffs] == ["num_layers", "gpu_flag_resets"]
    assert "one afd-ctl version on every worker" in diffs[0]
