"""The daemon's plain-Python state, driven without sockets."""

from __future__ import annotations

import asyncio

import pytest

from afd_ctl import routing
from afd_ctl.config import DaemonConfig
from afd_ctl.controller import Controller
from afd_ctl.errors import ControlError
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload


@pytest.mark.parametrize(
    ("m", "n", "routes", "senders"),
    [
        (1, 1, [[0]], [0]),
        (2, 1, [[0], [0]], [0]),
        (1, 2, [[0, 1]], [0]),
        (3, 2, [[0], [1], [0]], [0, 1]),
        (2, 4, [[0, 2], [1, 3]], [0, 1]),
    ],
)
def test_routing_covers_every_ratio(m: int, n: int, routes: list[list[int]], senders: list[int]):
    assert [routing.ffn_ranks_for(a, m, n) for a in range(m)] == routes
    assert routing.sender_ranks(m, n) == senders
    for f in range(n):
        # Every FFN rank has exactly one sender and receives hidden states from its routes.
        assert routing.sender_for(f, m, n) in senders
        assert routing.attention_ranks_for(f, m, n) == [a for a in range(m) if f in routes[a]]


@pytest.mark.parametrize(
    ("m", "n", "e", "routes", "senders"),
    [
        # One group: every attention rank reaches every FFN rank, each holding 1/N of experts.
        (2, 2, 2, [[0, 1], [0, 1]], [0]),
        (2, 4, 4, [[0, 1, 2, 3], [0, 1, 2, 3]], [0]),
        (4, 2, 2, [[0, 1]] * 4, [0]),
        # Two groups of four: attention ranks 0 and 2 feed FFN ranks 0, 2, 4, 6.
        (4, 8, 4, [[0, 2, 4, 6], [1, 3, 5, 7], [0, 2, 4, 6], [1, 3, 5, 7]], [0, 1]),
        # E = 1 where N <= M, and E = N / M where M divides N: today's default.
        (3, 2, 1, [[0], [1], [0]], [0, 1]),
        (2, 4, 2, [[0, 2], [1, 3]], [0, 1]),
    ],
)
def test_expert_parallel_size_sets_the_groups(
    m: int, n: int, e: int, routes: list[list[int]], senders: list[int]
):
    g = routing.groups_for_expert_parallel(m, n, e)
    assert g == n // e
    assert [routing.ffn_ranks_for(a, m, n, groups=g) for a in range(m)] == routes
    assert routing.sender_ranks(m, n, groups=g) == senders
    assert routing.max_peers(routing.Role.ATTENTION, m, n, groups=g) == e
    assert routing.max_peers(routing.Role.FFN, m, n, groups=g) == -(-m // g)
    for f in range(n):
        assert len(routing.ffn_group(f, m, n, groups=g)) == e  # it holds 1/E of the experts
        assert f in routing.subscriber_ranks(routing.sender_for(f, m, n, groups=g), m, n, groups=g)
        assert routing.attention_ranks_for(f, m, n, groups=g) == [
            a for a in range(m) if f in routes[a]
        ]
        assert routing.peer_ranks(routing.Role.FFN, f, m, n, groups=g) == tuple(
            routing.attention_ranks_for(f, m, n, groups=g)
        )
    # The default (None) is min(M, N) groups, as before the setting existed.
    assert routing.group_count(m, n) == min(m, n)
    assert [routing.ffn_ranks_for(a, m, n) for a in range(m)] == [
        routing.ffn_ranks_for(a, m, n, groups=min(m, n)) for a in range(m)
    ]


@pytest.mark.parametrize(
    ("m", "n", "e", "message"),
    [
        (2, 4, 3, "--expert-parallel-size 3 does not divide the 4 FFN ranks"),
        (1, 4, 2, "makes 2 FFN groups but there are only 1 attention ranks"),
        (2, 8, 2, "use an expert-parallel size of at least 4"),
        (2, 2, 0, "--expert-parallel-size 0 must be in 1..2"),
        (2, 2, 3, "--expert-parallel-size 3 must be in 1..2"),
    ],
)
def test_expert_parallel_sizes_that_cannot_work_are_refused(m: int, n: int, e: int, message: str):
    with pytest.raises(ValueError, match=message):
        routing.groups_for_expert_parallel(m, n, e)
    if e:  # the daemon's 0 is the default grouping
        with pytest.raises(ValueError, match=message):
            DaemonConfig(expect_attention=m, expect_ffn=n, expert_parallel_size=e)
    with pytest.raises(ValueError, match="--expert-parallel-size -1 must be in 1..1"):
        DaemonConfig(expert_parallel_size=-1)
    for groups in (0, 3, -1):
        with pytest.raises(ValueError, match=f"{groups} FFN groups for 2:2 .* must be in 1..2"):
            routing.group_count(2, 2, groups)


def test_the_daemon_routes_with_its_expert_parallel_size():
    """2:2 with E = 2: one group, one sender; both attention ranks see both FFN ranks."""

    async def scenario():
        config = DaemonConfig(expect_attention=2, expect_ffn=2, expert_parallel_size=2)
        assert config.ffn_groups == 1 and DaemonConfig(expect_ffn=2).ffn_groups == 1
        assert DaemonConfig(expect_attention=2, expect_ffn=2).ffn_groups == 2  # default
        c = Controller(config, first_epoch=100)
        a0 = c.open_session(WorkerSpec("a0", ATTENTION, dp_rank=0, dp_size=2), "p")
        a1 = c.open_session(WorkerSpec("a1", ATTENTION, dp_rank=1, dp_size=2), "p")
        f0 = c.open_session(WorkerSpec("f0", FFN, dp_rank=0, dp_size=2), "p")
        c.open_session(WorkerSpec("f1", FFN, dp_rank=1, dp_size=2), "p")
        m = c.membership
        assert m.ffn_groups == 1 and m.routes() == [(0, [0, 1]), (1, [0, 1])]
        assert m.is_sender(a0.worker) and not m.is_sender(a1.worker)
        assert [w.worker_id for w in m.peers_of(a1.worker)] == ["f0", "f1"]
        assert [w.worker_id for w in m.peers_of(f0.worker)] == ["a0", "a1"]
        assert [w.worker_id for w in m.subscribers_of(a0.worker)] == ["f0", "f1"]
        view = c.view_for(a1.worker)
        assert list(view.sender_ranks) == [0] and [len(r.ffn_ranks) for r in view.routes] == [2, 2]
        assert c.status().ffn_groups == 1
        assert make_controller(2, 2).status().ffn_groups == 2

    run(scenario())


def make_controller(m: int = 1, n: int = 1) -> Controller:
    return Controller(DaemonConfig(expect_attention=m, expect_ffn=n), first_epoch=100)


def run(coro):  # the controller's mailboxes need an event loop
    return asyncio.new_event_loop().run_until_complete(coro)


def test_join_and_loss_bump_the_epoch_and_health():
    async def scenario():
        c = make_controller(1, 2)
        a = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        f0 = c.open_session(WorkerSpec("f0", FFN, dp_rank=0, dp_size=2), "p")
        assert c.health == "NOT_SERVING"
        c.open_session(WorkerSpec("f1", FFN, dp_rank=1, dp_size=2), "p")
        assert c.health == "SERVING" and c.membership.epoch == 103
        c.close_session(f0, "killed")
        assert c.health == "NOT_SERVING" and c.membership.epoch == 104
        # a0 saw registered, two joins, SET_COMPLETE, then the loss.
        kinds = [m.WhichOneof("message") for m in list(a.mailbox._items)]
        assert kinds == ["registered", "event", "event", "event", "event"]
        assert a.mailbox._items[-1].event.worker.worker_id == "f0"

    run(scenario())


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (WorkerSpec("x", "BOGUS"), "role"),
        (WorkerSpec("", FFN), "worker_id"),
        (WorkerSpec("ffn\nINFO forged", FFN), "worker_id has a control or invisible character"),
        (WorkerSpec("ffn\u202e0", FFN), "worker_id has a control or invisible character"),
        # Issue 39: ids that look like another one (zero-width space, joiner, bidi mark, NBSP).
        (WorkerSpec("ffn\u200b0", FFN), "(U+200B at index 3)"),
        (WorkerSpec("ffn\u200d0", FFN), "(U+200D at index 3)"),
        (WorkerSpec("\u200fffn0", FFN), "(U+200F at index 0)"),
        (WorkerSpec("ffn\u00a00", FFN), "(U+00A0 at index 3)"),
        (WorkerSpec("ffn\ufeff", FFN), "(U+FEFF at index 3)"),
        (WorkerSpec("x", FFN, dp_rank=2, dp_size=2), "dp_rank"),
        (WorkerSpec("x", FFN, dp_size=3), "dp_size"),
        (WorkerSpec("x", FFN, data_plane_blob=b"x" * ((1 << 20) + 1)), "data_plane_blob"),
    ],
)
def test_bad_registrations_name_the_field(spec: WorkerSpec, field: str):
    c = make_controller()
    with pytest.raises(ControlError) as err:
        c.membership.join(spec, "p")
    assert err.value.code == "INVALID_ARGUMENT" and field in err.value.message
    assert c.membership.epoch == 100


def test_duplicate_slot_and_identity_are_refused():
    c = make_controller()
    c.membership.join(WorkerSpec("f0", FFN), "p")
    with pytest.raises(ControlError, match="held by worker_id 'f0'") as err:
        c.membership.join(WorkerSpec("f0-twin", FFN), "p")
    assert err.value.code == "ALREADY_EXISTS"
    with pytest.raises(ControlError, match="already registered"):
        c.membership.join(WorkerSpec("f0", ATTENTION), "p")


@pytest.mark.parametrize(
    ("mutate", "code", "field"),
    [
        (
            lambda p: p.stages[0].num_tokens_across_dp.append(1),
            "INVALID_ARGUMENT",
            "num_tokens_across_dp has 2",
        ),
        (
            lambda p: p.stages[0].num_tokens_across_dp.__setitem__(0, -1),
            "INVALID_ARGUMENT",
            "num_tokens_across_dp[0]",
        ),
        (
            lambda p: setattr(p.stages[0], "max_tokens_across_dp", 999),
            "INVALID_ARGUMENT",
            "max_tokens_across_dp",
        ),
        (
            lambda p: [p.stages[i].num_tokens_across_dp.append(1) for i in (1, 2)],
            "INVALID_ARGUMENT",
            "stages has 3",
        ),
        (lambda p: setattr(p, "epoch", 1), "FAILED_PRECONDITION", "epoch 1 is stale"),
        (lambda p: setattr(p, "sender_role_rank", 3), "PERMISSION_DENIED", "sender_role_rank"),
    ],
)
def test_bad_payloads_are_refused_and_change_nothing(mutate, code: str, field: str):
    reason = {"FAILED_PRECONDITION": "STALE_EPOCH", "PERMISSION_DENIED": "WRONG_SENDER_RANK"}
    reason = reason.get(code, "INVALID_STAGES")

    async def scenario():
        c = make_controller()
        a = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        f = c.open_session(WorkerSpec("f0", FFN), "p")
        queued = len(f.mailbox)
        payload = make_payload(5, 1, 1)
        payload.epoch = c.membership.epoch
        mutate(payload)
        with pytest.raises(ControlError) as err:
            c.publish(a, payload)
        assert err.value.code == code and field in err.value.message
        assert err.value.reason == reason  # what clients act on, not the words
        assert len(f.mailbox) == queued and c.steps_relayed == 0 and c.payloads_rejected == 1

    run(scenario())


def test_step_ids_must_increase_per_sender():
    async def scenario():
        c = make_controller()
        a = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        c.open_session(WorkerSpec("f0", FFN), "p")
        for step, ok in ((5, True), (6, True), (6, False), (4, False), (7, True)):
            payload = make_payload(step, 1, 1)
            payload.epoch = c.membership.epoch
            if ok:
                c.publish(a, payload)
            else:
                with pytest.raises(ControlError, match="does not increase") as err:
                    c.publish(a, payload)
                assert err.value.reason == "STEP_NOT_INCREASING"
        assert c.steps_relayed == 3

    run(scenario())


def test_slow_subscriber_is_cut_off_with_a_reason():
    async def scenario():
        c = Controller(DaemonConfig(subscriber_queue=8), first_epoch=1)
        tap = c.taps.add(include_payloads=True)
        a = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        f = c.open_session(WorkerSpec("f0", FFN), "p")
        for step in range(1, 20):
            payload = make_payload(step, 1, 1)
            payload.epoch = c.membership.epoch
            try:
                c.publish(a, payload)
            except ControlError as exc:  # incomplete once f0 is cut off
                assert (exc.code, exc.reason) == ("UNAVAILABLE", "SET_INCOMPLETE")
                break
        assert f.mailbox.closed and "fell behind" in f.worker.lost_reason
        assert c.membership.count(FFN) == 0
        # The tap's queue is --subscriber-queue long too; it was cut off and dropped.
        assert tap.mailbox.closed and len(tap.mailbox) == 0 and tap not in c.taps

    run(scenario())


def test_only_the_registering_session_publishes_as_its_worker():
    async def scenario():
        c = make_controller()
        a = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        c.open_session(WorkerSpec("f0", FFN), "p")
        secret = c.sessions["a0"].publish_secret
        assert len(secret) == 32
        for worker_id, given, code in (
            ("", secret, "INVALID_ARGUMENT"),
            ("nobody", secret, "FAILED_PRECONDITION"),
            ("a0", "", "PERMISSION_DENIED"),
            ("a0", "f" * 32, "PERMISSION_DENIED"),
        ):
            with pytest.raises(ControlError) as err:
                c.publisher(worker_id, given)
            assert err.value.code == code
        assert c.publisher("a0", secret) is a
        # The stream dies with its session: a re-registration has a new session and secret.
        c.close_session(a, "gone")
        payload = make_payload(1, 1, 1)
        payload.epoch = c.membership.epoch
        with pytest.raises(ControlError) as err:
            c.publish(a, payload)
        assert (err.value.code, err.value.reason) == ("FAILED_PRECONDITION", "SESSION_ENDED")
        again = c.open_session(WorkerSpec("a0", ATTENTION), "p")
        assert again.publish_secret != secret
        with pytest.raises(ControlError, match="is not the one issued"):
            c.publisher("a0", secret)

    run(scenario())


def test_config_reads_flags_then_environment_then_defaults():
    env = {"AFD_CTL_EXPECT_FFN": "3", "AFD_CTL_LIVENESS_TIMEOUT_S": "1.5", "AFD_CTL_LISTEN": "x:1"}
    config = DaemonConfig.resolve({"listen": "127.0.0.1:7", "expect_ffn": None}, env)
    assert (config.listen, config.expect_ffn, config.liveness_timeout_s) == ("127.0.0.1:7", 3, 1.5)
    with pytest.raises(ValueError, match="AFD_CTL_EXPECT_FFN"):
        DaemonConfig.resolve({}, {"AFD_CTL_EXPECT_FFN": "two"})
    env = {
        "AFD_CTL_EXPECT_ATTENTION": "2",
        "AFD_CTL_EXPECT_FFN": "4",
        "AFD_CTL_EXPERT_PARALLEL_SIZE": "4",
    }
    config = DaemonConfig.resolve({"expert_parallel_size": None}, env)
    assert (config.expert_parallel_size, config.ffn_groups) == (4, 1)
    assert DaemonConfig.resolve({"expert_parallel_size": 2}, env).ffn_groups == 2
    with pytest.raises(ValueError, match="--listen"):
        DaemonConfig(listen="nocolon")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        DaemonConfig(tls_cert="/etc/hostname")


def test_a_payload_that_overtakes_the_complete_view_is_delivered():
    """The daemon's first payload of an epoch can reach a worker just before the view that says
    the set is complete: next_payload waits for it within its timeout instead of refusing."""
    from afd_ctl.errors import AfdNotReady
    from afd_ctl.membership_view import MembershipView
    from afd_ctl.v1 import afd_pb2

    forming = afd_pb2.View(epoch=3, expected_attention=1, expected_ffn=2, complete=False)
    view = MembershipView("127.0.0.1:1")
    with view.cond:
        view.on_registered(afd_pb2.Registered(view=forming))
    with pytest.raises(AfdNotReady, match=r"incomplete now; .*call wait_complete\(\)"):
        view.next_payload(0.01)
    view.on_payload(make_payload(1, 1, 1))
    assert view.next_payload(5).step_id == 1


def test_a_worker_of_another_model_is_refused_naming_both_sides():
    """Issue 22, item 8: a DeepSeek-V2 FFN worker cannot join a DeepSeek-V3 attention
    worker; the refusal names each differing field with both values. Workers that send no
    fingerprint (simulated ones) are not checked."""
    from afd_ctl.fingerprint import ModelFingerprint

    v3 = ModelFingerprint("DeepseekV3ForCausalLM", 61, 7168, 256, 1, "bfloat16")
    v2 = ModelFingerprint("DeepseekV2ForCausalLM", 60, 5120, 160, 2, "bfloat16")
    c = make_controller()
    c.membership.join(WorkerSpec("a0", ATTENTION, model=v3), "p")
    with pytest.raises(ControlError) as err:
        c.membership.join(WorkerSpec("f0", FFN, model=v2), "p")
    assert err.value.code == "FAILED_PRECONDITION"
    message = err.value.message
    assert "model mismatch: ffn worker 'f0'" in message and "attention rank 0 (a0)" in message
    for field in (
        "architecture 'DeepseekV2ForCausalLM' vs 'DeepseekV3ForCausalLM'",
        "num_layers 60 vs 61",
        "hidden_size 5120 vs 7168",
        "num_routed_experts 160 vs 256",
        "num_shared_experts 2 vs 1",
    ):
        assert field in message, message
    assert "dtype '" not in message  # the same on both sides
    c.membership.join(WorkerSpec("f1", FFN, model=v3), "p")  # the same model joins
    c2 = make_controller()
    c2.membership.join(WorkerSpec("a0", ATTENTION, model=v3), "p")
    c2.membership.join(WorkerSpec("f0", FFN), "p")  # none sent: not checked


@pytest.mark.parametrize(
    "theirs,said",
    [
        ("136811cff8a3-ee333138105e42dd", "other values: another seed, fine-tune or revision"),
        ("ffff11cff8a3-1da4fee910c16763", "config.json or the tensors' names, dtypes or shapes"),
        ("136811cff8a3-headers-only", "give both roles the same setting"),
        ("dummy", "give both roles the same --load-format"),
    ],
)
def test_a_weights_digest_mismatch_says_what_differs_and_what_to_do(theirs: str, said: str):
    """Issue 38: the refusal named `weights_digest` only, while the digest covers config.json
    and the tensor layout too (README, "Weights digest"): it now says which part differs and
    what to do, in one line."""
    from dataclasses import replace

    from afd_ctl.fingerprint import ModelFingerprint

    mine = ModelFingerprint("DeepseekV2ForCausalLM", 2, 256, 8, 1, "float32", "")
    c = make_controller()
    c.membership.join(WorkerSpec("a0", ATTENTION, model=replace(mine, weights_digest=theirs)), "p")
    with pytest.raises(ControlError) as err:
        c.membership.join(
            WorkerSpec(
                "f0", FFN, model=replace(mine, weights_digest="136811cff8a3-1da4fee910c16763")
            ),
            "p",
        )
    message = err.value.message
    assert f"weights_digest '136811cff8a3-1da4fee910c16763' vs '{theirs}' (" in message, message
    assert said in message and "\n" not in message, message
    assert "start both roles from the same checkpoint files (config.json included)" in message
