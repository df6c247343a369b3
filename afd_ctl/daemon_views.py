"""What the daemon shows of its state, as protos: a worker's info, its view of the membership,
and the status (`afd-ctl status`, `GetStatus`). Read-only functions of the controller's
plain-Python state, so `Controller` holds behaviour and these hold presentation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from afd_ctl.membership import ATTENTION, FFN, ROLES, Membership, Worker
from afd_ctl.v1 import afd_pb2
from afd_ctl.wire import ROLE_TO_PROTO

if TYPE_CHECKING:
    from afd_ctl.controller import Controller


def worker_info(worker: Worker) -> afd_pb2.WorkerInfo:
    spec = worker.spec
    return afd_pb2.WorkerInfo(
        worker_id=spec.worker_id,
        role=ROLE_TO_PROTO[spec.role],
        role_rank=spec.role_rank,
        dp_rank=spec.dp_rank,
        dp_size=spec.dp_size,
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        peer=worker.peer,
        registered_at_s=worker.registered_at_s,
        step_socket=spec.step_socket,
    )


def view_for(m: Membership, incarnation: str, worker: Worker, hold: bool = False) -> afd_pb2.View:
    """The membership as `worker` needs it: routes, senders, and its peers' blobs; during a
    planned change (issue 37) the target, and whether this worker leaves, waits to be routed
    or must hold."""
    routed = m.routed(worker)
    view = afd_pb2.View(
        epoch=m.epoch,
        controller_incarnation=incarnation,
        expected_attention=m.expected[ATTENTION],
        expected_ffn=m.expected[FFN],
        # A worker the topology does not route yet (pending) has no complete set to serve in.
        complete=m.complete and routed,
        sender_ranks=m.sender_ranks(),
        ffn_groups=m.ffn_groups,
        leaving=m.leaving(worker),
        hold=hold and routed,
        pending=not routed,
    )
    if m.target is not None:
        view.target.CopyFrom(m.target.to_proto())
    for attention_rank, ffn_ranks in m.routes():
        view.routes.add(attention_rank=attention_rank, ffn_ranks=ffn_ranks)
    for peer in m.peers_of(worker):
        view.peers.add(worker=worker_info(peer), data_plane_blob=peer.spec.data_plane_blob)
    return view


def daemon_view(c: Controller) -> afd_pb2.View:
    """The daemon's view at a change, for status and taps (peers are per worker: none)."""
    m = c.membership
    view = afd_pb2.View(
        epoch=m.epoch,
        complete=m.complete,
        controller_incarnation=c.incarnation,
        expected_attention=m.expected[ATTENTION],
        expected_ffn=m.expected[FFN],
        ffn_groups=m.ffn_groups,
        hold=c.scaling.holding,
    )
    if m.target is not None:
        view.target.CopyFrom(m.target.to_proto())
    return view


def status_of(c: Controller) -> afd_pb2.Status:
    m = c.membership
    status = afd_pb2.Status(
        health=c.health,
        health_state=c.health,  # the enum by name
        epoch=m.epoch,
        controller_incarnation=c.incarnation,
        last_step_id=c.last_step_id,
        steps_relayed=c.steps_relayed,
        payloads_rejected=c.payloads_rejected,
        uptime_s=time.monotonic() - c.started_at,
        listen=c.listen_address,
        recent_events=list(c.recent_events),
        loads=c.timing.loads(),
        ffn_groups=m.ffn_groups,
        current=m.topology.to_proto(),
        epoch_history=list(c.scaling.history),
        last_change=c.scaling.last_result,
    )
    change = c.scaling.status()
    if change is not None:
        status.change.CopyFrom(change)
    for role in ROLES:
        status.roles.add(
            role=ROLE_TO_PROTO[role], expected=m.expected[role], registered=m.count(role)
        )
    for tap in c.taps:
        status.taps.add(
            peer=tap.peer,
            include_payloads=tap.include_payloads,
            queued=len(tap.mailbox),
            queue_capacity=tap.mailbox.capacity,
            delivered=tap.mailbox.delivered,
            last_step_id=tap.mailbox.last_step_id,
        )
    for session in c.sessions.values():
        if session.worker.role == FFN:
            status.subscribers.add(
                worker_id=session.worker.worker_id,
                queued=len(session.mailbox),
                last_step_id=session.mailbox.last_step_id,
                queue_capacity=session.mailbox.capacity,
            )
    return status


def scale_reply(c: Controller, message: str) -> afd_pb2.ScaleResponse:
    """`afd-ctl scale`'s answer: the membership now, the target (if a change is under way) and
    what happens next."""
    m = c.membership
    reply = afd_pb2.ScaleResponse(current=m.topology.to_proto(), message=message)
    if m.target is not None:
        reply.target.CopyFrom(m.target.to_proto())
    return reply
