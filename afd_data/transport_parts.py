"""The parts of one worker's data plane, and ``build_parts``, the factory that wires them.

A transport is a registered buffer (``LocalAgent``), a peer set, an inbox of notifications, a
write queue, a credit count, the step's plan and a poller that every wait goes through, with
the first loss of an epoch in one ``Loss``. ``build_parts`` hands each part the parts it uses
(no callbacks into the transport). ``NixlTransport`` (membership, steps) and its role's
endpoint (``afd_data.endpoints``: the tensor calls) both work on the same ``TransportParts``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from afd_ctl.routing import Role, peer_ranks
from afd_data import credits
from afd_data.agent import LocalAgent
from afd_data.config import TransportConfig
from afd_data.credits import Credits
from afd_data.errors import AfdBadInput
from afd_data.inbox import Inbox
from afd_data.layout import BufferLayout
from afd_data.loss import Loss
from afd_data.memory import Array, CudaMemory, HostMemory
from afd_data.notify import Kind
from afd_data.peers import PeerSet
from afd_data.poller import Poller
from afd_data.step_plan import StepPlan
from afd_data.write_queue import WriteQueue


@dataclasses.dataclass(eq=False)
class TransportParts:
    """Everything one transport owns; ``plan`` is replaced at every ``begin_step``."""

    name: str
    role: Role
    role_rank: int
    config: TransportConfig
    peer_ranks: tuple[int, ...]
    layout: BufferLayout
    local: LocalAgent
    mem: HostMemory | CudaMemory  # local.mem
    view: Callable[[int, int, int, str], Array]  # local.view: a (rows, cols) buffer view
    peers: PeerSet
    credits: Credits
    inbox: Inbox
    loss: Loss
    queue: WriteQueue
    poller: Poller
    plan: StepPlan = dataclasses.field(default_factory=StepPlan)
    closed: bool = False

    def reset_steps(self) -> None:
        self.plan = StepPlan()
        credits.reset(self.credits)
        self.inbox.arrived.clear()

    def check_open(self) -> None:
        if self.closed:
            raise AfdBadInput(f"data plane {self.name} is closed")

    def check_ready(self) -> None:
        self.check_open()
        if self.loss.lost is not None:
            raise self.loss.lost
        if self.inbox.epoch is None:
            raise AfdBadInput(f"data plane {self.name}: call connect(epoch, peers) first")

    def check_stage(self, layer: int, stage: int) -> None:
        self.check_ready()
        if self.credits.step is None:
            raise AfdBadInput(f"data plane {self.name}: call begin_step() before moving tensors")
        if not 0 <= stage < len(self.plan.counts):
            raise AfdBadInput(
                f"stage {stage} is not in step {self.credits.step}, which has "
                f"{len(self.plan.counts)} stage(s)"
            )
        if not 0 <= layer < 1 << 32:
            raise AfdBadInput(f"layer {layer} is not in 0..2**32-1")

    def await_peers(self, layer: int, stage: int, timeout_s: float | None, what: str) -> None:
        """Waits for (step, layer, stage) from every peer and checks the row counts."""
        step = self.credits.step
        assert step is not None
        peers = self.peers.peers
        keys = [(step, layer, stage, p.spec.role_rank) for p in peers]
        if not self.inbox.complete(keys):
            bound = self.config.recv_timeout_s if timeout_s is None else timeout_s
            self.poller.await_arrivals(keys, peers, bound, what)
        self.inbox.take(keys, self.plan.rows_by_rank[stage], self.plan.counts[stage], what)


def build_parts(
    name: str, role: Role, role_rank: int, config: TransportConfig, device: str
) -> TransportParts:
    """Registers the buffer and wires the parts of ``role``'s transport (rank checked)."""
    count = config.num_attention if role is Role.ATTENTION else config.num_ffn
    if config.elastic:  # a rank the next membership may route (issue 37)
        count = config.max_attention if role is Role.ATTENTION else config.max_ffn
    if not 0 <= role_rank < count:
        field = f"{'max' if config.elastic else 'num'}_{role.label}"
        raise AfdBadInput(
            f"role_rank {role_rank} is outside 0..{count - 1} (TransportConfig.{field})"
        )
    layout = BufferLayout(config, role)
    local = LocalAgent(name, role, role_rank, config, layout, device)
    credit = Credits.empty(config.num_stages)
    inbox = Inbox(
        name,
        role,
        role_rank,
        config.num_stages,
        Kind.OUTPUT if role is Role.ATTENTION else Kind.HIDDEN,  # what this role receives
        4 * layout.num_slots * layout.num_peers + 16,
        functools.partial(credits.check_arrival, credit, layout.slot),
    )
    loss = Loss(name, inbox, credit)
    queue = WriteQueue(
        name, local.nixl, local.send_table, local.send_dlist, layout.num_slots, config, loss
    )
    return TransportParts(
        name=name,
        role=role,
        role_rank=role_rank,
        config=config,
        peer_ranks=routed_peers(config, role, role_rank),
        layout=layout,
        local=local,
        mem=local.mem,
        view=local.view,
        peers=PeerSet(local.nixl),
        credits=credit,
        inbox=inbox,
        loss=loss,
        queue=queue,
        poller=Poller(name, local.nixl, config, role_rank, inbox, queue, loss),
    )


def routed_peers(config: TransportConfig, role: Role, role_rank: int) -> tuple[int, ...]:
    """The ranks of the other role that ``config``'s routing gives ``role_rank`` (none for an
    elastic worker outside that membership: its first connect brings its routing)."""
    count = config.num_attention if role is Role.ATTENTION else config.num_ffn
    if config.elastic and role_rank >= count:
        return ()
    return peer_ranks(
        role, role_rank, config.num_attention, config.num_ffn, groups=config.ffn_groups
    )
