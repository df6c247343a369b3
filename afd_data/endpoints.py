"""One endpoint per role: the three tensor calls each side makes per (layer, stage).

``endpoint_for(parts)`` picks the role's endpoint once, when ``NixlTransport`` is built, and
the transport hands its tensor calls to it, so no call checks the role at run time (the other
role's calls refuse, from the shared base). Flow control is in ``afd_data.credits``; the
parts an endpoint works on (buffer, peers, queue, credits, plan) in
``afd_data.transport_parts``.
"""

from __future__ import annotations

import dataclasses

from afd_ctl.routing import Role
from afd_data import credits, notify
from afd_data.errors import AfdBadInput
from afd_data.memory import Array
from afd_data.notify import Kind
from afd_data.step_plan import PeerSlice
from afd_data.transport_parts import TransportParts


@dataclasses.dataclass(frozen=True)
class HiddenBatch:
    """What ``recv_hidden`` returns. Views into the receive slot: valid until ``send_output``
    of the same (layer, stage)."""

    step_id: int
    layer: int
    stage: int
    # (total_rows, hidden_size): every attention peer's rows, concatenated in rank order.
    hidden: Array
    # (total_rows, router_width), or None when router_width is 0.
    router: Array | None
    slices: tuple[PeerSlice, ...]


class Endpoint:
    """A role's tensor calls; each refuses here, and the role's endpoint implements its three."""

    ROLE: Role
    ANSWER: str  # the call that answers an outstanding layer

    def __init__(self, parts: TransportParts):
        self._p = parts

    def hidden_buffer(self, layer: int, stage: int) -> tuple[Array, Array | None]:
        raise self._wrong_role(Role.ATTENTION, "hidden_buffer")

    def send_hidden(
        self, layer: int, stage: int, hidden: Array, router: Array | None = None
    ) -> None:
        raise self._wrong_role(Role.ATTENTION, "send_hidden")

    def recv_outputs(self, layer: int, stage: int, timeout_s: float | None = None) -> list[Array]:
        raise self._wrong_role(Role.ATTENTION, "recv_outputs")

    def recv_hidden(self, layer: int, stage: int, timeout_s: float | None = None) -> HiddenBatch:
        raise self._wrong_role(Role.FFN, "recv_hidden")

    def output_buffer(self, layer: int, stage: int) -> Array:
        raise self._wrong_role(Role.FFN, "output_buffer")

    def send_output(self, layer: int, stage: int, output: Array) -> None:
        raise self._wrong_role(Role.FFN, "send_output")

    def _wrong_role(self, role: Role, method: str) -> AfdBadInput:
        return AfdBadInput(f"{method}() is for {role.label} workers; this is {self.ROLE.label}")


class AttentionEndpoint(Endpoint):
    """Sends hidden states to every FFN peer and takes one output from each."""

    ROLE = Role.ATTENTION
    ANSWER = "recv_outputs"

    def hidden_buffer(self, layer: int, stage: int) -> tuple[Array, Array | None]:
        """Zero-copy send: the (rows, hidden) and (rows, router) staging views of this rank's
        rows for (layer, stage); fill them and pass them to ``send_hidden``."""
        p = self._p
        p.check_stage(layer, stage)
        slot = p.layout.slot(layer, stage)
        p.poller.await_slot(slot)
        rows = p.plan.my_rows[stage]
        cfg = p.config
        hidden = p.view(p.layout.send_hidden[slot].offset, rows, cfg.hidden_size, cfg.dtype)
        router = None
        if cfg.router_width:
            router = p.view(
                p.layout.send_router[slot].offset, rows, cfg.router_width, cfg.router_dtype
            )
        return hidden, router

    def send_hidden(
        self, layer: int, stage: int, hidden: Array, router: Array | None = None
    ) -> None:
        """WRITEs this rank's hidden states (rows = max(1, its token count)) to every FFN
        peer. Asynchronous: returns once posted."""
        p = self._p
        p.check_stage(layer, stage)
        cfg = p.config
        slot = p.layout.slot(layer, stage)
        credits.check_send_hidden(p.credits, slot, layer, stage, cfg.layers_in_flight)
        rows = p.plan.my_rows[stage]
        hint = lambda: (  # noqa: E731  (built only when the shape is wrong)
            f"attention DP rank {p.role_rank // cfg.attention_tp_size} has "
            f"{p.plan.counts[stage][p.role_rank // cfg.attention_tp_size]} tokens in "
            f"stage {stage} of step {p.credits.step} (an idle rank sends 1 dummy row)"
        )
        hidden = p.mem.check(hidden, rows, cfg.hidden_size, cfg.dtype, "send_hidden hidden", hint)
        if cfg.router_width:
            if router is None:
                raise AfdBadInput(
                    f"send_hidden: router_width is {cfg.router_width}: pass router=(rows, "
                    f"{cfg.router_width}) {cfg.router_dtype} with the hidden states"
                )
            router = p.mem.check(
                router, rows, cfg.router_width, cfg.router_dtype, "send_hidden router", hint
            )
        elif router is not None:
            raise AfdBadInput("send_hidden: router given but TransportConfig.router_width is 0")

        p.poller.await_slot(slot)
        staged = p.view(p.layout.send_hidden[slot].offset, rows, cfg.hidden_size, cfg.dtype)
        if hidden is not staged and p.mem.data_ptr(hidden) != p.mem.data_ptr(staged):
            p.mem.copy(staged, hidden)
        regions: tuple[int, ...] = (slot,)
        if cfg.router_width:
            staged_r = p.view(
                p.layout.send_router[slot].offset, rows, cfg.router_width, cfg.router_dtype
            )
            if router is not staged_r and p.mem.data_ptr(router) != p.mem.data_ptr(staged_r):
                p.mem.copy(staged_r, router)
            regions = (slot, p.layout.num_slots + slot)
        p.mem.sync()
        msg = notify.pack(
            Kind.HIDDEN,
            p.inbox.epoch or 0,
            p.credits.step or 0,
            layer,
            stage,
            p.role_rank,
            rows,
        )
        offsets = p.plan.offsets[stage]
        for peer in p.peers.peers:
            p.queue.post(
                peer, slot, regions, 0, offsets[peer.pos], rows, msg, Kind.HIDDEN, layer, stage
            )
        credits.hidden_sent(p.credits, slot, layer, stage)

    def recv_outputs(self, layer: int, stage: int, timeout_s: float | None = None) -> list[Array]:
        """Waits for the output of (layer, stage) from every FFN peer: one (rows, hidden) view
        per FFN peer in rank order. With several (expert-parallel) FFN peers, sum them.
        The views stay valid until send_hidden of the next layer in the same slot."""
        p = self._p
        p.check_stage(layer, stage)
        slot = p.layout.slot(layer, stage)
        credits.check_recv_outputs(p.credits, slot, layer, stage)
        p.await_peers(layer, stage, timeout_s, "outputs")
        rows = p.plan.my_rows[stage]
        cfg = p.config
        outputs = [
            p.view(p.layout.recv_output[slot][peer.pos].offset, rows, cfg.hidden_size, cfg.dtype)
            for peer in p.peers.peers
        ]
        credits.outputs_taken(p.credits, slot, layer, stage)
        return outputs


class FfnEndpoint(Endpoint):
    """Takes the packed hidden states of every attention peer and WRITEs each its output."""

    ROLE = Role.FFN
    ANSWER = "send_output"

    def recv_hidden(self, layer: int, stage: int, timeout_s: float | None = None) -> HiddenBatch:
        """Waits for (layer, stage) from every attention peer and returns the concatenation
        (views, valid until send_output of the same layer and stage)."""
        p = self._p
        p.check_stage(layer, stage)
        slot = p.layout.slot(layer, stage)
        credits.check_recv_hidden(p.credits, slot, layer, stage)
        p.await_peers(layer, stage, timeout_s, "hidden states")
        cfg = p.config
        total = p.plan.total_rows[stage]
        hidden = p.view(p.layout.recv_hidden[slot].offset, total, cfg.hidden_size, cfg.dtype)
        router = None
        if cfg.router_width:
            router = p.view(
                p.layout.recv_router[slot].offset, total, cfg.router_width, cfg.router_dtype
            )
        credits.hidden_taken(p.credits, slot, layer, stage)
        assert p.credits.step is not None
        return HiddenBatch(p.credits.step, layer, stage, hidden, router, p.plan.slices[stage])

    def output_buffer(self, layer: int, stage: int) -> Array:
        """Zero-copy send: the (total_rows, hidden) staging view for the output of (layer,
        stage); compute into it and pass it to ``send_output``."""
        p = self._p
        p.check_stage(layer, stage)
        slot = p.layout.slot(layer, stage)
        p.poller.await_slot(slot)
        cfg = p.config
        return p.view(
            p.layout.send_output[slot].offset,
            p.plan.total_rows[stage],
            cfg.hidden_size,
            cfg.dtype,
        )

    def send_output(self, layer: int, stage: int, output: Array) -> None:
        """WRITEs each attention peer its slice of the (total_rows, hidden) output. This also
        tells the peers this rank is done reading the hidden states of (layer, stage)."""
        p = self._p
        p.check_stage(layer, stage)
        slot = p.layout.slot(layer, stage)
        credits.check_send_output(p.credits, slot, layer, stage)
        cfg = p.config
        total = p.plan.total_rows[stage]
        hint = lambda: "rows = sum of the batch's slices (recv_hidden().hidden.shape[0])"  # noqa: E731
        output = p.mem.check(output, total, cfg.hidden_size, cfg.dtype, "send_output", hint)
        p.poller.await_slot(slot)
        staged = p.view(p.layout.send_output[slot].offset, total, cfg.hidden_size, cfg.dtype)
        if output is not staged and p.mem.data_ptr(output) != p.mem.data_ptr(staged):
            p.mem.copy(staged, output)
        p.mem.sync()
        epoch, step = p.inbox.epoch or 0, p.credits.step or 0
        for peer, piece in zip(p.peers.peers, p.plan.slices[stage], strict=True):
            msg = notify.pack(Kind.OUTPUT, epoch, step, layer, stage, p.role_rank, piece.rows)
            p.queue.post(
                peer, slot, (slot,), piece.start, 0, piece.rows, msg, Kind.OUTPUT, layer, stage
            )
        credits.output_sent(p.credits, slot, stage)


def endpoint_for(parts: TransportParts) -> Endpoint:
    """The endpoint of the parts' role: the factory ``NixlTransport`` builds its calls with."""
    return AttentionEndpoint(parts) if parts.role is Role.ATTENTION else FfnEndpoint(parts)
