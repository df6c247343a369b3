"""GpuHop: the per-layer exchange driven by the GPUs themselves, between workers on one host.

It runs `afd_data.gpu_protocol`'s operation lists on CUDA streams (`afd_data.cuda_driver`):
peer copies through CUDA IPC mappings, flag writes and `cuStreamWaitValue32` waits. Nothing in a
layer waits on the host: the attention side captures whole decode steps in CUDA graphs, and the
FFN side enqueues a whole step at once.

It lives beside the worker's NixlTransport and uses its buffer, layout and peers: the NIXL path
stays connected (the rendezvous, membership and epochs are the transport's), and the path is
chosen per worker at connect (`gpu_protocol.choose_path`: same host and both buffers exportable;
AFD_DATA_GPU_HOP=off turns it off). A GPU wait cannot time out by itself, so the host watches
(vllm_ext.exchange.gpu_watchdog): once a peer is lost or a step passes its bound, it calls
`poison` until the stream has drained (the step then fails on the host and its outputs are
never used).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from afd_ctl.errors import AfdTimeout
from afd_ctl.routing import Role, peer_ranks
from afd_data.blob import PeerBlob
from afd_data.config import TransportConfig
from afd_data.cuda_driver import CudaDriverError, driver, write_flag
from afd_data.gpu_protocol import (
    GPU,
    NIXL,
    POISON,
    AttentionPeer,
    Compute,
    Copy,
    FlagLayout,
    FlagUse,
    Loc,
    Op,
    PathChoice,
    Wait,
    Write,
    attention_send_ops,
    attention_take_ops,
    choose_path,
    epoch_tag,
    ffn_ops,
    flag_use,
    flag_write_setting,
    gpu_hop_setting,
    one_path,
)
from afd_data.layout import BufferLayout
from afd_data.partial_sums import sum_partials

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Mapped:
    """An attention peer's buffer, mapped into this (FFN) process."""

    rank: int
    my_pos: int  # this FFN worker's position in that peer's FFN peer list
    mapping: int  # what cuIpcOpenMemHandle returned (closed at reconnect)
    base: int  # its data-plane buffer
    flags: int  # its flag words
    layout: BufferLayout
    flag_layout: FlagLayout


class GpuHop:
    """One worker's GPU-driven hop; `path` is GPU once `connect` chose it."""

    def __init__(
        self, role: Role, rank: int, config: TransportConfig, layout: BufferLayout, local: Any
    ) -> None:
        """`local`: the transport's LocalAgent (its buffer, memory and flag layout)."""
        self.role = role
        self.rank = rank
        self.config = config
        self.layout = layout
        self.mem = local.mem
        self.base: int = local.base
        self.flag_layout: FlagLayout = local.flags
        self.endpoint = local.gpu_endpoint
        self.choice = PathChoice(NIXL, "not connected")
        self.epoch = 0
        self._peers: dict[int, _Mapped] = {}
        self._ffn_positions = 0  # attention: FFN peers connected
        self._side = 0  # the watchdog's non-blocking stream
        self._hidden_row = self.config.hidden_size * self.config.itemsize
        self._router_row = self.config.router_width * self.config.router_itemsize
        self._views: dict[tuple[int, int, int, str], Any] = {}
        self.flag_writes = flag_write_setting()
        schedule = (config.num_layers, config.layers_in_flight, config.gpu_flag_resets)
        # How the flags of a layer are raised and met (the same on both sides: shape fields).
        self.flag_use: Callable[[int], FlagUse] = lambda layer: flag_use(layer, *schedule)

    @property
    def path(self) -> str:
        return self.choice.path

    # -- connect ----------------------------------------------------------------------------
    def connect(
        self,
        epoch: int,
        peers: Sequence[tuple[int, PeerBlob]],
        timeout_s: float,
        idle: Callable[[], None] = lambda: None,
    ) -> PathChoice:
        """Chooses the path to `peers` ((position in this worker's peer list, blob), rank
        order) and, for the GPU path, maps them (FFN side) or waits until they have drained
        and zeroes the flags (attention side; see gpu_protocol's "Reconnect")."""
        setting = gpu_hop_setting()
        choices = {b.role_rank: choose_path(self.endpoint, b.gpu, setting) for _, b in peers}
        what = f"{self.role.label} rank {self.rank}"
        self.choice = one_path(choices, what) if choices else PathChoice(NIXL, "no peers")
        self.epoch = epoch
        if self.path != GPU:
            self._close_mappings()
            return self.choice
        # How the flags are written and met, said in the worker's "afd data path" line.
        met = "written back after each wait" if self.flag_use(0).reset else "met by bit"
        reason = f"{self.choice.reason}; flags by {self.flag_writes} writes, {met}"
        self.choice = PathChoice(GPU, reason)
        cuda = driver()
        if not self._side:
            self._side = cuda.non_blocking_stream()
        tag = epoch_tag(epoch)
        if self.role is Role.FFN:
            self._close_mappings()
            for _, blob in peers:
                self._map(cuda, blob)
            for peer in self._peers.values():
                word = peer.flags + 4 * peer.flag_layout.word("drained", (peer.my_pos,))
                cuda.memset32(self._side, word, tag, 1)
            self._sync_side(timeout_s, "writing the drained marks")
        else:
            self._ffn_positions = len(peers)
            self._await_drained(cuda, tag, timeout_s, idle)
            fl = self.flag_layout
            cuda.memset32(self._side, self.mem.flags_ptr, 0, 2 * fl.num_slots * fl.num_ffn_peers)
            self._sync_side(timeout_s, "zeroing the flags")
        return self.choice

    def _map(self, cuda: Any, blob: PeerBlob) -> None:
        assert blob.gpu is not None
        mapping = cuda.ipc_open(blob.gpu.ipc_handle)
        m, n, g = self.config.num_attention, self.config.num_ffn, self.config.ffn_groups
        stages = int(blob.shape.get("num_stages") or 1)
        layout = BufferLayout(dataclasses.replace(self.config, num_stages=stages), Role.ATTENTION)
        self._peers[blob.role_rank] = _Mapped(
            rank=blob.role_rank,
            my_pos=peer_ranks(Role.ATTENTION, blob.role_rank, m, n, groups=g).index(self.rank),
            mapping=mapping,
            base=mapping + blob.gpu.buffer_offset,
            flags=mapping + blob.gpu.flags_offset,
            layout=layout,
            flag_layout=FlagLayout(layout.num_slots, layout.num_peers),
        )

    def _await_drained(
        self, cuda: Any, tag: int, timeout_s: float, idle: Callable[[], None]
    ) -> None:
        """Polls this worker's DRAINED words (and, through `idle`, NIXL: a peer may be settling
        its transfers with this side) until every FFN peer marked the new epoch."""
        first = self.mem.flags_ptr + 4 * self.flag_layout.word("drained", (0,))
        deadline = time.monotonic() + timeout_s
        while True:
            marks = cuda.read_words(first, self._ffn_positions)
            if all(mark == tag for mark in marks):
                return
            if time.monotonic() > deadline:
                raise AfdTimeout(
                    f"attention rank {self.rank}: the FFN peers did not mark their GPU streams "
                    f"drained for epoch {self.epoch} within {timeout_s:.0f} s (marks {marks})"
                )
            idle()
            time.sleep(0.001)

    def _sync_side(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        cuda = driver()
        while not cuda.stream_idle(self._side):
            if time.monotonic() > deadline:
                raise AfdTimeout(f"GPU hop: {what} did not finish within {timeout_s:.0f} s")
            time.sleep(50e-6)

    def _close_mappings(self) -> None:
        for peer in self._peers.values():
            try:
                driver().ipc_close(peer.mapping)
            except CudaDriverError as exc:  # a dead peer's mapping: nothing more to do
                logger.debug("GPU hop: closing the mapping of rank %d: %s", peer.rank, exc)
        self._peers.clear()

    # -- addresses --------------------------------------------------------------------------
    def _addr(self, loc: Loc, inputs: dict[str, int]) -> int:
        if loc.area in ("input", "router", "out"):
            row_bytes = self._router_row if loc.area == "router" else self._hidden_row
            return inputs[loc.area] + loc.row * row_bytes
        mine = loc.owner == self.role.label and loc.rank == self.rank
        if mine:
            base, layout, flags, fl = self.base, self.layout, self.mem.flags_ptr, self.flag_layout
        else:
            peer = self._peers[loc.rank]
            base, layout, flags, fl = peer.base, peer.layout, peer.flags, peer.flag_layout
        if loc.area in ("hidden_ready", "output_ready", "drained"):
            return flags + 4 * fl.word(loc.area, loc.index)
        if loc.area == "recv_output":
            slot, pos = loc.index
            return base + layout.recv_output[slot][pos].offset + loc.row * self._hidden_row
        region = getattr(layout, loc.area)[loc.index[0]]
        row_bytes = self._router_row if loc.area.endswith("router") else self._hidden_row
        return base + region.offset + loc.row * row_bytes

    def _run(
        self,
        ops: list[Op],
        stream: int,
        inputs: dict[str, int],
        compute: Callable[[], Any] | None = None,
    ) -> Any:
        cuda = driver()
        out = None
        for op in ops:
            if isinstance(op, Copy):
                src = op.src
                if src.area == "input" and op.router:
                    src = dataclasses.replace(src, area="router")
                row = self._router_row if op.router else self._hidden_row
                cuda.copy(
                    stream, self._addr(op.dst, inputs), self._addr(src, inputs), op.rows * row
                )
            elif isinstance(op, Write):
                addr = self._addr(op.flag, inputs)
                write_flag(cuda, stream, addr, op.value, op.barrier, self.flag_writes)
            elif isinstance(op, Wait):  # for >= value, or for any bit of it (op.mask)
                wait = cuda.wait_any_bit if op.mask else cuda.wait_geq
                wait(stream, self._addr(op.flag, inputs), op.value)
            elif isinstance(op, Compute):
                assert compute is not None
                out = compute()
                inputs["out"] = int(out.data_ptr())
        return out

    def _view(self, offset: int, rows: int, cols: int, dtype: str) -> Any:
        key = (offset, rows, cols, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.mem.view(offset, rows, cols, dtype)
        return view

    # -- attention side ---------------------------------------------------------------------
    def send(self, layer: int, stage: int, hidden: Any, router: Any, stream: int) -> None:
        """The send half of one layer's round trip on `stream`, enqueued (or captured) without
        a host wait: `hidden` (rows, hidden_size) into the send slot, the peers' flags raised."""
        rows = int(hidden.shape[0])
        if rows > self.config.max_tokens_per_peer:
            raise ValueError(
                f"GPU hop: {rows} rows in one layer, over max_tokens_per_peer "
                f"{self.config.max_tokens_per_peer}"
            )
        slot = self.layout.slot(layer, stage)
        hidden = hidden.reshape(rows, -1).contiguous()
        inputs = {"input": int(hidden.data_ptr())}
        if self._router_row:
            router = router.reshape(rows, -1).contiguous()
            inputs["router"] = int(router.data_ptr())
        ops = attention_send_ops(
            self.rank, slot, rows, self._ffn_positions, bool(self._router_row), self.flag_use(layer)
        )
        self._run(ops, stream, inputs)

    def take(self, layer: int, stage: int, out: Any, stream: int) -> None:
        """The take half on `stream`: wait for every FFN peer's output of this layer and stage
        and sum them into `out` (rows, hidden_size)."""
        rows = int(out.shape[0])
        slot = self.layout.slot(layer, stage)
        ops = attention_take_ops(self.rank, slot, self._ffn_positions, self.flag_use(layer))
        self._run(ops, stream, {})
        cfg = self.config
        outputs = [
            self._view(self.layout.recv_output[slot][pos].offset, rows, cfg.hidden_size, cfg.dtype)
            for pos in range(self._ffn_positions)
        ]
        sum_partials(out.view(rows, -1), outputs)  # float32, rounded once (issue 23)

    # -- FFN side ---------------------------------------------------------------------------
    def ffn_layer(
        self,
        layer: int,
        stage: int,
        slices: Sequence[Any],
        stream: int,
        compute: Callable[[Any, Any], Any],
    ) -> None:
        """One layer and stage on `stream`: the attention peers' rows in (`slices`: the step
        plan's PeerSlice per peer), `compute(x, router)`, each peer its output slice back."""
        slot = self.layout.slot(layer, stage)
        peers = [
            AttentionPeer(s.role_rank, self._peers[s.role_rank].my_pos, s.start, s.rows)
            for s in slices
        ]
        x, router = self.ffn_inputs(layer, stage, slices)
        ops = ffn_ops(
            self.rank, layer, stage, slot, peers, bool(self._router_row), self.flag_use(layer)
        )
        self._run(ops, stream, {}, lambda: compute(x, router).contiguous())

    def ffn_inputs(self, layer: int, stage: int, slices: Sequence[Any]) -> tuple[Any, Any]:
        """The receive slot's views a layer computes on: (rows, router columns or None)."""
        slot = self.layout.slot(layer, stage)
        total = sum(s.rows for s in slices)
        cfg = self.config
        x = self._view(self.layout.recv_hidden[slot].offset, total, cfg.hidden_size, cfg.dtype)
        router = None
        if self._router_row:
            router = self._view(
                self.layout.recv_router[slot].offset, total, cfg.router_width, cfg.router_dtype
            )
        return x, router

    # -- failures ---------------------------------------------------------------------------
    def poison(self) -> None:
        """Writes POISON into every flag this side's stream may wait on (on the watchdog's own
        stream, which runs while the compute stream is parked)."""
        if not self._side:
            return
        cuda = driver()
        if self.role is Role.ATTENTION:
            fl = self.flag_layout
            first = self.mem.flags_ptr + 4 * fl.word("output_ready", (0, 0))
            cuda.memset32(self._side, first, POISON, fl.num_slots * fl.num_ffn_peers)
            return
        for peer in self._peers.values():
            fl = peer.flag_layout
            first = peer.flags + 4 * fl.word("hidden_ready", (0, 0))
            try:
                cuda.memset32(self._side, first, POISON, fl.num_slots * fl.num_ffn_peers)
            except CudaDriverError as exc:
                logger.warning("GPU hop: poisoning attention rank %d: %s", peer.rank, exc)

    def close(self) -> None:
        self._close_mappings()
