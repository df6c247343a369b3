"""One endpoint per role: the three tensor calls each side makes per (layer, stage).

``NixlTransport(name, role, ...)`` returns one of these, so the role is decided once, at
construction, and no call checks it at run time (the other role's calls refuse, from the
shared base). Flow control is in ``afd_data.credits``, the shared machinery in
``afd_data.nixl_transport``.
"""

from __future__ import annotations

import dataclasses

from afd_ctl.routing import Role
from afd_data import credits, notify
from afd_data.errors import AfdBadInput
from afd_data.memory import Array
from afd_data.nixl_transport import NixlTransport
from afd_data.notify import Kind, Notice
from afd_data.step_plan import PeerSlice


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


class AttentionEndpoint(NixlTransport):
    """Sends hidden states to every FFN peer and takes one output from each."""

    ROLE = Role.ATTENTION
    EXPECTED = Kind.OUTPUT
    ANSWER = "recv_outputs"

    def hidden_buffer(self, layer: int, stage: int) -> tuple[Array, Array | None]:
        """Zero-copy send: the (rows, hidden) and (rows, router) staging views of this rank's
        rows for (layer, stage); fill them and pass them to ``send_hidden``."""
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        self._queue.await_slot(slot)
        rows = self._plan.my_rows[stage]
        cfg = self.config
        hidden = self._view(self._layout.send_hidden[slot].offset, rows, cfg.hidden_size, cfg.dtype)
        router = None
        if cfg.router_width:
            router = self._view(
                self._layout.send_router[slot].offset, rows, cfg.router_width, cfg.router_dtype
            )
        return hidden, router

    def send_hidden(
        self, layer: int, stage: int, hidden: Array, router: Array | None = None
    ) -> None:
        """WRITEs this rank's hidden states (rows = max(1, its token count)) to every FFN
        peer. Asynchronous: returns once posted."""
        self._check_stage(layer, stage)
        cfg = self.config
        slot = self._layout.slot(layer, stage)
        credits.check_send_hidden(self._credits, slot, layer, stage, cfg.layers_in_flight)
        rows = self._plan.my_rows[stage]
        hint = lambda: (  # noqa: E731  (built only when the shape is wrong)
            f"attention DP rank {self.role_rank // cfg.attention_tp_size} has "
            f"{self._plan.counts[stage][self.role_rank // cfg.attention_tp_size]} tokens in "
            f"stage {stage} of step {self._credits.step} (an idle rank sends 1 dummy row)"
        )
        hidden = self._mem.check(
            hidden, rows, cfg.hidden_size, cfg.dtype, "send_hidden hidden", hint
        )
        if cfg.router_width:
            if router is None:
                raise AfdBadInput(
                    f"send_hidden: router_width is {cfg.router_width}: pass router=(rows, "
                    f"{cfg.router_width}) {cfg.router_dtype} with the hidden states"
                )
            router = self._mem.check(
                router, rows, cfg.router_width, cfg.router_dtype, "send_hidden router", hint
            )
        elif router is not None:
            raise AfdBadInput("send_hidden: router given but TransportConfig.router_width is 0")

        self._queue.await_slot(slot)
        staged = self._view(self._layout.send_hidden[slot].offset, rows, cfg.hidden_size, cfg.dtype)
        if hidden is not staged and self._mem.data_ptr(hidden) != self._mem.data_ptr(staged):
            self._mem.copy(staged, hidden)
        regions: tuple[int, ...] = (slot,)
        if cfg.router_width:
            staged_r = self._view(
                self._layout.send_router[slot].offset, rows, cfg.router_width, cfg.router_dtype
            )
            if router is not staged_r and self._mem.data_ptr(router) != self._mem.data_ptr(
                staged_r
            ):
                self._mem.copy(staged_r, router)
            regions = (slot, self._layout.num_slots + slot)
        self._mem.sync()
        msg = notify.pack(
            Kind.HIDDEN,
            self._inbox.epoch or 0,
            self._credits.step or 0,
            layer,
            stage,
            self.role_rank,
            rows,
        )
        offsets = self._plan.offsets[stage]
        for peer in self._peers.peers:
            self._queue.post(
                peer, slot, regions, 0, offsets[peer.pos], rows, msg, Kind.HIDDEN, layer, stage
            )
        credits.hidden_sent(self._credits, slot, layer, stage)

    def recv_outputs(self, layer: int, stage: int, timeout_s: float | None = None) -> list[Array]:
        """Waits for the output of (layer, stage) from every FFN peer: one (rows, hidden) view
        per FFN peer in rank order. With several (expert-parallel) FFN peers, sum them.
        The views stay valid until send_hidden of the next layer in the same slot."""
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        credits.check_recv_outputs(self._credits, slot, layer, stage)
        self._await_peers(layer, stage, timeout_s, "outputs")
        rows = self._plan.my_rows[stage]
        cfg = self.config
        outputs = [
            self._view(
                self._layout.recv_output[slot][p.pos].offset, rows, cfg.hidden_size, cfg.dtype
            )
            for p in self._peers.peers
        ]
        credits.outputs_taken(self._credits, slot, layer, stage)
        return outputs

    def _screen(self, n: Notice) -> None:
        credits.check_output_notice(self._credits, n, self._layout.slot(n.layer, n.stage))


class FfnEndpoint(NixlTransport):
    """Takes the packed hidden states of every attention peer and WRITEs each its output."""

    ROLE = Role.FFN
    EXPECTED = Kind.HIDDEN
    ANSWER = "send_output"

    def recv_hidden(self, layer: int, stage: int, timeout_s: float | None = None) -> HiddenBatch:
        """Waits for (layer, stage) from every attention peer and returns the concatenation
        (views, valid until send_output of the same layer and stage)."""
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        credits.check_recv_hidden(self._credits, slot, layer, stage)
        self._await_peers(layer, stage, timeout_s, "hidden states")
        cfg = self.config
        total = self._plan.total_rows[stage]
        hidden = self._view(
            self._layout.recv_hidden[slot].offset, total, cfg.hidden_size, cfg.dtype
        )
        router = None
        if cfg.router_width:
            router = self._view(
                self._layout.recv_router[slot].offset, total, cfg.router_width, cfg.router_dtype
            )
        credits.hidden_taken(self._credits, slot, layer, stage)
        assert self._credits.step is not None
        return HiddenBatch(
            self._credits.step, layer, stage, hidden, router, self._plan.slices[stage]
        )

    def output_buffer(self, layer: int, stage: int) -> Array:
        """Zero-copy send: the (total_rows, hidden) staging view for the output of (layer,
        stage); compute into it and pass it to ``send_output``."""
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        self._queue.await_slot(slot)
        cfg = self.config
        return self._view(
            self._layout.send_output[slot].offset,
            self._plan.total_rows[stage],
            cfg.hidden_size,
            cfg.dtype,
        )

    def send_output(self, layer: int, stage: int, output: Array) -> None:
        """WRITEs each attention peer its slice of the (total_rows, hidden) output. This also
        tells the peers this rank is done reading the hidden states of (layer, stage)."""
        self._check_stage(layer, stage)
        slot = self._layout.slot(layer, stage)
        credits.check_send_output(self._credits, slot, layer, stage)
        cfg = self.config
        total = self._plan.total_rows[stage]
        hint = lambda: "rows = sum of the batch's slices (recv_hidden().hidden.shape[0])"  # noqa: E731
        output = self._mem.check(output, total, cfg.hidden_size, cfg.dtype, "send_output", hint)
        self._queue.await_slot(slot)
        staged = self._view(
            self._layout.send_output[slot].offset, total, cfg.hidden_size, cfg.dtype
        )
        if output is not staged and self._mem.data_ptr(output) != self._mem.data_ptr(staged):
            self._mem.copy(staged, output)
        self._mem.sync()
        epoch, step = self._inbox.epoch or 0, self._credits.step or 0
        for peer, piece in zip(self._peers.peers, self._plan.slices[stage], strict=True):
            msg = notify.pack(Kind.OUTPUT, epoch, step, layer, stage, self.role_rank, piece.rows)
            self._queue.post(
                peer, slot, (slot,), piece.start, 0, piece.rows, msg, Kind.OUTPUT, layer, stage
            )
        credits.output_sent(self._credits, slot, stage)

    def _screen(self, n: Notice) -> None:
        credits.check_hidden_notice(self._credits, n)


def endpoint_class(role: Role) -> type[NixlTransport]:
    """The endpoint that ``NixlTransport(name, role, ...)`` builds."""
    return AttentionEndpoint if role is Role.ATTENTION else FfnEndpoint
