"""The GPU-driven hop's protocol: which stream operations each side runs per (layer, stage),
where its flags live, and when a pair of workers uses it. Pure Python (no CUDA): the CUDA
executor (`afd_data.gpu_hop`) and the tests' simulator run the same operation lists.

Who touches what
----------------
The attention side only touches its *own* memory, so the CUDA graphs it captures (vLLM's FULL
decode graphs, captured once at start-up) stay valid when an FFN server is replaced: it copies
its rows into its send slot, raises a "hidden ready" flag per FFN peer, meets an "output
ready" flag per FFN peer (see "Flags" below), and reads the outputs from its receive slot. The
FFN side does every cross-process access (through CUDA IPC mappings of the attention worker's
buffer, opened at connect): it meets the attention worker's "hidden ready" flag, pulls the
rows, computes, pushes each peer its output slice, and raises that peer's "output ready" flag.
An FFN server captures its own graphs again after every reconnect.

Flags
-----
Flags are 32-bit words, and a captured wait must stay valid on every replay; a flag is raised
and met in one of two ways (`flag_use`, the same on both sides: it follows from shape fields):
- **Bits** (the default where the model's layers are known and each slot is used at least twice
  a step): each use of a slot raises one bit, different from the slot's previous use, the last
  use of a step included (bits 0 and 1 alternate, and an odd-numbered last use takes bit 2), and
  the consumer waits for that bit (`Wait.mask`) and leaves the word as it is. A stale word
  therefore never meets a wait, and no one writes a flag back: two flag writes per layer fewer,
  each ~1.8 µs of stream work on one side's critical path (README, 2026-12-07).
- **Resets** (otherwise, or TransportConfig.gpu_flag_resets "each"): the producer raises READY,
  the consumer waits for >= READY and puts the word back to 0 right after.
A host watchdog releases a stuck wait by writing POISON (>= READY, and every bit a wait masks)
into the flags its stream waits on, again and again until the stream has drained; the step then
fails on the host (the poisoned step's outputs are never used).

Slots are the data plane's (`layout.slot`): a slot (and its flags) is written again only after
its previous contents were consumed, because each layer's answer is the next layer's credit
(the FFN side pulls layer L's rows before it answers layer L, and the attention side sends
layer L + slots only after it took the answer of layer L + slots - 1).

Reconnect
---------
After a loss, an old FFN stream that is still running could write stale "output ready" flags
into the attention worker's memory. So at connect the FFN side first drains its stream, then
writes the new epoch's tag into its DRAINED word in each attention peer's flag area; the
attention side zeroes its flags only once every FFN peer's DRAINED word shows the new epoch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

READY = 1
POISON = 0x7FFF_FFFF
POISON_BIT = 1 << 30  # in POISON, and in every mask a bits-mode wait checks
# The two exchange paths a worker can run (PathChoice.path).
GPU, NIXL = "gpu", "nixl"
# AFD_DATA_GPU_HOP: "auto" (the GPU path between peers on one host whose buffers are CUDA
# memory), "off" (always NIXL).
GPU_HOP_SETTINGS = ("auto", "off")
# AFD_DATA_GPU_FLAG_WRITES: how the GPU path raises and resets its flags. "stream" (the
# default): `cuStreamWriteValue32` with its memory barrier (1.96 µs in a graph on one H100);
# "memset": a one-word `cuMemsetD32Async` after the copies in stream order (what poison uses),
# a candidate to measure against it (benchmarks/gpu_hop_ops.py's memset_flag) before it becomes
# the default, for attention and FFN on one GPU: a memset has no memory barrier, and across GPUs
# nothing yet shows the rows landing before their flag. Both sides may differ: a flag is a word.
FLAG_WRITE_SETTINGS = ("stream", "memset")


@dataclasses.dataclass(frozen=True)
class Loc:
    """A place in a worker's memory: `owner` ("attention" or "ffn") and its `rank`, an `area`
    ("hidden_ready", "output_ready", "drained" flags; "send_hidden", "send_router",
    "recv_output" rows of an attention worker; "recv_hidden", "recv_router", "out" of an FFN
    worker; "input" for the caller's tensor) and an index into it."""

    owner: str
    rank: int
    area: str
    index: tuple[int, ...] = ()
    row: int = 0  # first row


@dataclasses.dataclass(frozen=True)
class Copy:
    dst: Loc
    src: Loc
    rows: int
    router: bool = False  # router columns instead of hidden rows


@dataclasses.dataclass(frozen=True)
class Write:
    flag: Loc
    value: int
    barrier: bool = True  # earlier writes visible first


@dataclasses.dataclass(frozen=True)
class Wait:
    flag: Loc
    value: int = READY  # until the word is >= value (mask: until word & value != 0)
    mask: bool = False


@dataclasses.dataclass(frozen=True)
class Compute:
    layer: int
    stage: int


Op = Copy | Write | Wait | Compute


@dataclasses.dataclass(frozen=True)
class FlagLayout:
    """The attention worker's flag words: hidden_ready[slot][ffn_pos],
    output_ready[slot][ffn_pos], drained[ffn_pos]."""

    num_slots: int
    num_ffn_peers: int

    @property
    def words(self) -> int:
        return 2 * self.num_slots * self.num_ffn_peers + self.num_ffn_peers

    def word(self, area: str, index: tuple[int, ...]) -> int:
        s, p = self.num_slots, self.num_ffn_peers
        if area == "drained":
            (pos,) = index
            return 2 * s * p + pos
        slot, pos = index
        if not (0 <= slot < s and 0 <= pos < p):
            raise IndexError(f"flag {area}{index} outside {s} slots x {p} peers")
        base = {"hidden_ready": 0, "output_ready": s * p}[area]
        return base + slot * p + pos

    def flags_waited_on(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every flag the attention worker's stream waits on (what its watchdog poisons)."""
        return [
            ("output_ready", (slot, pos))
            for slot in range(self.num_slots)
            for pos in range(self.num_ffn_peers)
        ]


@dataclasses.dataclass(frozen=True)
class FlagUse:
    """How one (layer, stage)'s flags are raised and met (see "Flags" above): `value` is what
    the producer writes; with `reset` the consumer waits for >= READY and writes 0 back, else it
    waits for the bit `value` (or POISON) and leaves the word."""

    value: int = READY
    reset: bool = True

    def meet(self, flag: Loc) -> list[Op]:
        """The consumer's operations on `flag`."""
        if self.reset:
            return [Wait(flag), Write(flag, 0, barrier=False)]
        return [Wait(flag, self.value | POISON_BIT, mask=True)]


def met(word: int, wait: Wait) -> bool:
    """Whether `wait` is met by a flag word holding `word` (what cuStreamWaitValue32 checks)."""
    return bool(word & wait.value) if wait.mask else word >= wait.value


RESETS = FlagUse()
# TransportConfig.gpu_flag_resets: "auto" (bits where `flag_use` can, else resets), "each".
FLAG_RESET_SETTINGS = ("auto", "each")


def flag_use(layer: int, num_layers: int, layers_in_flight: int, setting: str = "auto") -> FlagUse:
    """The flags of `layer` (every stage alike) when a step runs layers 0 .. num_layers - 1 and
    slot = layer % layers_in_flight: bits when every slot is used at least twice a step
    (num_layers >= 2 * layers_in_flight; num_layers 0: not known), else resets."""
    lif = layers_in_flight
    if setting == "each" or num_layers < 2 * lif:
        return RESETS
    if not 0 <= layer < num_layers:
        raise ValueError(f"GPU hop: layer {layer} outside the model's {num_layers} layers")
    uses = (num_layers - layer % lif + lif - 1) // lif  # of this slot in a step
    use = layer // lif
    if uses % 2 and use == uses - 1:
        return FlagUse(1 << 2, reset=False)  # not bit 0, the next step's first use
    return FlagUse(1 << (use % 2), reset=False)


def attention_send_ops(
    rank: int, slot: int, rows: int, ffn_peers: int, router: bool, use: FlagUse = RESETS
) -> list[Op]:
    """The send half of one (layer, stage) on attention rank `rank`: its `rows` rows (from
    "input") into its send slot, then a "hidden ready" flag per FFN peer."""
    me = ("attention", rank)
    ops: list[Op] = [Copy(Loc(*me, "send_hidden", (slot,)), Loc(*me, "input"), rows)]
    if router:
        ops.append(Copy(Loc(*me, "send_router", (slot,)), Loc(*me, "input"), rows, router=True))
    ops += [Write(Loc(*me, "hidden_ready", (slot, p)), use.value) for p in range(ffn_peers)]
    return ops


def attention_take_ops(rank: int, slot: int, ffn_peers: int, use: FlagUse = RESETS) -> list[Op]:
    """The take half: meet each FFN peer's "output ready" flag."""
    ops: list[Op] = []
    for p in range(ffn_peers):
        ops += use.meet(Loc("attention", rank, "output_ready", (slot, p)))
    return ops


def attention_ops(
    rank: int, slot: int, rows: int, ffn_peers: int, router: bool, use: FlagUse = RESETS
) -> list[Op]:
    """One (layer, stage) on attention rank `rank`: send `rows` rows (from "input") to its
    `ffn_peers` FFN peers, then wait for each one's output. Everything is its own memory."""
    return attention_send_ops(rank, slot, rows, ffn_peers, router, use) + attention_take_ops(
        rank, slot, ffn_peers, use
    )


@dataclasses.dataclass(frozen=True)
class AttentionPeer:
    """One attention peer as an FFN worker sees it: its rank, this FFN worker's position in its
    FFN peer list, and its rows of this stage (at `start` in the packed receive slot)."""

    rank: int
    my_pos: int
    start: int
    rows: int


def ffn_ops(
    rank: int,
    layer: int,
    stage: int,
    slot: int,
    peers: Sequence[AttentionPeer],
    router: bool,
    use: FlagUse = RESETS,
) -> list[Op]:
    """One (layer, stage) on FFN rank `rank`: take every attention peer's rows, compute, answer."""
    me = ("ffn", rank)
    ops: list[Op] = []
    for a in peers:
        ops += use.meet(Loc("attention", a.rank, "hidden_ready", (slot, a.my_pos)))
        ops.append(
            Copy(
                Loc(*me, "recv_hidden", (slot,), a.start),
                Loc("attention", a.rank, "send_hidden", (slot,)),
                a.rows,
            )
        )
        if router:
            ops.append(
                Copy(
                    Loc(*me, "recv_router", (slot,), a.start),
                    Loc("attention", a.rank, "send_router", (slot,)),
                    a.rows,
                    router=True,
                )
            )
    ops.append(Compute(layer, stage))
    for a in peers:
        ops.append(
            Copy(
                Loc("attention", a.rank, "recv_output", (slot, a.my_pos)),
                Loc(*me, "out", (), a.start),
                a.rows,
            )
        )
        ops.append(Write(Loc("attention", a.rank, "output_ready", (slot, a.my_pos)), use.value))
    return ops


def epoch_tag(epoch: int) -> int:
    """A non-zero 31-bit word naming a membership epoch (what a DRAINED word holds)."""
    return epoch % 0x7FFF_FFFE + 1


# -- which path a pair of workers takes ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuEndpoint:
    """What a worker's blob says about its GPU hop: the host it runs on and the CUDA IPC handle
    of its buffer (None where it has no CUDA buffer or could not export one)."""

    host_id: str
    ipc_handle: bytes
    buffer_offset: int  # of the data-plane buffer inside the exported allocation
    flags_offset: int  # of the flag words inside the exported allocation


@dataclasses.dataclass(frozen=True)
class PathChoice:
    path: str  # GPU or NIXL
    reason: str

    @property
    def label(self) -> str:
        """How the log names the path."""
        return {GPU: "GPU-driven", NIXL: "host-driven NIXL"}[self.path]


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name`, one of `choices` (the first when unset or empty)."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def gpu_hop_setting() -> str:
    return _env_choice("AFD_DATA_GPU_HOP", GPU_HOP_SETTINGS)


def flag_write_setting() -> str:
    return _env_choice("AFD_DATA_GPU_FLAG_WRITES", FLAG_WRITE_SETTINGS)


def choose_path(mine: GpuEndpoint | None, theirs: GpuEndpoint | None, setting: str) -> PathChoice:
    """The path between two workers, from both blobs alone, so both sides decide alike."""
    if setting == "off":
        return PathChoice(NIXL, "AFD_DATA_GPU_HOP=off")
    if mine is None or theirs is None:
        who = "this worker" if mine is None else "the peer"
        return PathChoice(NIXL, f"{who} has no CUDA IPC buffer (host memory, or not exportable)")
    if mine.host_id != theirs.host_id:
        return PathChoice(NIXL, "the peer is on another host")
    return PathChoice(GPU, "same host, CUDA IPC")


def one_path(choices: dict[int, PathChoice], what: str) -> PathChoice:
    """A worker's path over all its peers (rank -> choice): one path for all of them, or a
    ValueError that names the mix (each peer pair decides alike, but a worker runs one path)."""
    paths = {c.path for c in choices.values()}
    if len(paths) > 1:
        by_path = {p: sorted(r for r, c in choices.items() if c.path == p) for p in paths}
        raise ValueError(
            f"{what}: its peers need different paths (GPU-driven to ranks {by_path[GPU]}, "
            f"NIXL to ranks {by_path[NIXL]}); put every peer of a worker on one host, or "
            "set AFD_DATA_GPU_HOP=off on every worker"
        )
    return next(iter(choices.values()))
