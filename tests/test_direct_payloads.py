"""Step payloads straight from the attention sender to its FFN workers on the same host
(afd_ctl.direct), beside afd-ctl's relay: every step runs once, in the order published,
whichever path brings it first, and a receiver takes datagrams only from its peers."""

from __future__ import annotations

import random

import pytest

from afd_ctl import direct
from afd_ctl.client import ControllerClient
from afd_ctl.errors import AfdStopped
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload
from afd_ctl.v1 import afd_pb2
from vllm_ext.ffn.payloads import Payloads

pytestmark = pytest.mark.skipif(not direct.supported(), reason="abstract Unix sockets: Linux")


def _payload(step_id: int, epoch: int = 1) -> afd_pb2.AFDControlPayload:
    payload = make_payload(step_id, 1, 1)
    payload.epoch = epoch
    return payload


@pytest.mark.parametrize("seed", range(40))
def test_each_step_runs_once_in_published_order_whatever_arrives_first(seed: int):
    """Published steps (ids with gaps, an epoch change in the middle), each direct copy dropped
    with probability 0.3, both paths interleaved at random: the chain hands out exactly the
    published sequence."""
    rng = random.Random(seed)
    published: list[afd_pb2.AFDControlPayload] = []
    direct_msgs: list[afd_pb2.DirectPayload] = []
    step_id = 0
    for epoch in (1, 2):
        prev = 0
        for _ in range(rng.randint(5, 25)):
            step_id += rng.randint(1, 3)
            payload = _payload(step_id, epoch)
            published.append(payload)
            if rng.random() > 0.3:
                direct_msgs.append(afd_pb2.DirectPayload(payload=payload, prev_step_id=prev))
            prev = step_id
    chain = direct.StepChain()
    ran: list[tuple[int, int]] = []
    relay, datagrams = list(published), list(direct_msgs)
    epoch = 1

    def drain() -> None:
        while (ready := chain.ready(epoch)) is not None:
            ran.append((ready.epoch, ready.step_id))

    while relay or datagrams:
        drain()
        if datagrams and (not relay or rng.random() < 0.5):
            chain.direct(datagrams.pop(0))
        else:
            payload = relay.pop(0)
            if chain.relayed(payload):
                epoch = payload.epoch  # the FFN server follows a payload of a newer epoch
                ran.append((payload.epoch, payload.step_id))
    drain()
    assert ran == [(p.epoch, p.step_id) for p in published]


def test_a_receiver_takes_datagrams_only_from_its_peers():
    sender_sock, ffn_sock, stranger = direct.StepSocket(), direct.StepSocket(), direct.StepSocket()
    try:
        sender = direct.DirectSender(sender_sock)
        sender.connect(
            {"ffn-0": ffn_sock.name, "elsewhere": "afd-steps-" + "0" * 32 + "-" + "1" * 16}
        )
        assert sender.targets == ["ffn-0"]  # a socket of another host is never tried
        inbox = direct.DirectInbox(ffn_sock)
        inbox.allow([sender_sock.name])
        data = afd_pb2.DirectPayload(payload=_payload(1)).SerializeToString()
        stranger.sock.sendto(data, "\0" + ffn_sock.name)
        stranger.sock.sendto(b"not a protobuf \xff\xff", "\0" + ffn_sock.name)
        sender.send(_payload(1))
        inbox.wait(5.0)
        inbox.take()
        assert (inbox.received, inbox.refused) == (1, 2)
        ready = inbox.chain.ready(1)
        assert ready is not None and ready.step_id == 1
        assert inbox.chain.ready(1) is None
        # A peer that exited: given up at once, never an error on the attention host.
        ffn_sock.close()
        sender.send(_payload(2))
        assert sender.targets == [] and sender.sent == 1
    finally:
        for s in (sender_sock, stranger):
            s.close()


def test_a_full_queue_drops_the_copy_and_the_relay_brings_it():
    sender_sock, ffn_sock = direct.StepSocket(), direct.StepSocket()
    try:
        sender = direct.DirectSender(sender_sock)
        sender.connect({"ffn-0": ffn_sock.name})
        for step in range(1, 2001):  # nobody reads: the receiver's queue fills up
            sender.send(_payload(step))
        assert sender.dropped > 0 and sender.sent + sender.dropped == 2000
    finally:
        sender_sock.close()
        ffn_sock.close()


def test_the_sender_knows_when_every_subscriber_is_reached_directly():
    sender_sock, ffn_sock = direct.StepSocket(), direct.StepSocket()
    try:
        sender = direct.DirectSender(sender_sock)
        sender.connect({"ffn-0": ffn_sock.name}, subscribers=1)
        assert sender.covers_all
        sender.connect({"ffn-0": ffn_sock.name}, subscribers=2)  # ffn-1 has no socket here
        assert not sender.covers_all
        sender.connect({"ffn-0": ffn_sock.name}, subscribers=1)
        ffn_sock.close()  # it exited: given up, its payloads come through afd-ctl only
        sender.send(_payload(1))
        assert not sender.covers_all and sender.targets == []
    finally:
        sender_sock.close()
        ffn_sock.close()


@pytest.mark.parametrize(("window_s", "poll_s"), [(0.0, 0.0), (direct.RELAY_COALESCE_S, 0.0),
                                                  (direct.RELAY_COALESCE_S, 0.05)])  # fmt: skip
def test_payloads_through_a_real_daemon_come_directly_and_once(
    start_daemon, window_s: float, poll_s: float
):
    """A real afd-ctl relays every payload; the FFN side also gets each one straight from the
    sender and runs each step once, in order, most of them from the direct path; stop comes
    from the relay. With a coalescing window (every subscriber reached directly) the sender's
    copies to afd-ctl go several to a message, and still every one arrives, in order; with the
    FFN side polling (afd ffn_poll_s) the same, its looks counted."""
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    attention_sock, ffn_sock = direct.StepSocket(), direct.StepSocket()
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN, step_socket=ffn_sock.name))
    attention = ControllerClient(
        daemon.address, WorkerSpec("attn-0", ATTENTION, step_socket=attention_sock.name)
    )
    try:
        ffn.connect(timeout_s=10)
        attention.connect(timeout_s=10)
        view_a, view_f = attention.wait_complete(10), ffn.wait_complete(10)
        assert [p.worker.step_socket for p in view_f.peers] == [attention_sock.name]
        sender = direct.DirectSender(attention_sock)
        subscribers = direct.subscriber_ranks(view_a, attention.role_rank)
        sender.connect(direct.subscriber_sockets(view_a, attention.role_rank), len(subscribers))
        assert sender.covers_all
        attention.publisher.window = lambda: window_s
        inbox = direct.DirectInbox(ffn_sock)
        inbox.allow(direct.peer_sockets(view_f))
        payloads = Payloads(ffn, inbox, poll_s=poll_s)
        steps = 300
        ran = []
        for step in range(1, steps + 1):
            payload = make_payload(step, 1, 1)
            attention.publish(payload)
            sender.send(payload)
            got = payloads.next(10.0, view_f.epoch)
            ran.append(got.step_id)
        attention.publish(afd_pb2.AFDControlPayload(step_id=steps + 1, stop=True))
        with pytest.raises(AfdStopped, match="sent stop at step 301"):
            payloads.next(10.0, view_f.epoch)  # no step runs twice before it
        assert ran == list(range(1, steps + 1))
        stats = payloads.stats()
        assert stats["payloads_direct"] + stats["payloads_relayed"] == steps
        assert stats["payloads_direct"] > steps // 2, stats
        assert stats["payloads_direct_refused"] == 0
        assert ("payload_polls" in stats) == bool(poll_s)
        per_message = attention.publisher.sent.stats()["publish_payloads_per_message"]
        assert per_message > (2 if window_s else 0), per_message  # several steps per message
    finally:
        attention.close()
        ffn.close()
        attention_sock.close()
        ffn_sock.close()


def test_a_registration_with_a_malformed_step_socket_is_refused(start_daemon):
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    bad = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN, step_socket="/tmp/sock"))
    try:
        with pytest.raises(Exception, match="step_socket '/tmp/sock' is not"):
            bad.connect(timeout_s=10)
    finally:
        bad.close()


def test_the_setting_is_auto_on_or_off():
    from vllm_ext.config import AfdConfig

    section = {"role": "ffn", "controller": "localhost:50051"}
    assert AfdConfig.resolve(section, {}).direct_payloads == "auto"
    assert AfdConfig.resolve({**section, "direct_payloads": False}, {}).direct_payloads == "off"
    assert AfdConfig.resolve(section, {"AFD_DIRECT_PAYLOADS": "on"}).direct_payloads == "on"
    with pytest.raises(ValueError, match=r"direct_payloads must be one of \('auto', 'on', 'off'\)"):
        AfdConfig.resolve({**section, "direct_payloads": "maybe"}, {})


def test_the_coalescing_window_is_a_setting():
    from vllm_ext.config import AfdConfig
    from vllm_ext.control import ControlAccess

    section = {"role": "attention", "controller": "localhost:50051"}
    afd = AfdConfig.resolve(section, {})
    assert afd.publish_coalesce_s == direct.RELAY_COALESCE_S
    assert ControlAccess.of(afd).publish_coalesce_s == direct.RELAY_COALESCE_S
    off = AfdConfig.resolve(section, {"AFD_PUBLISH_COALESCE_S": "0"})
    assert ControlAccess.of(off).publish_coalesce_s == 0.0
    with pytest.raises(ValueError, match=r"publish_coalesce_s must be in 0..1 s, got 5"):
        AfdConfig.resolve({**section, "publish_coalesce_s": 5}, {})
    assert AfdConfig.resolve(section, {}).ffn_poll_s == 0.0
    assert AfdConfig.resolve(section, {"AFD_FFN_POLL_S": "0.05"}).ffn_poll_s == 0.05
    with pytest.raises(ValueError, match=r"ffn_poll_s must be in 0..1 s, got 2"):
        AfdConfig.resolve({**section, "ffn_poll_s": 2}, {})
