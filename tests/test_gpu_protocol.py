"""The GPU-driven hop's protocol (afd_data.gpu_protocol), run by a simulator instead of GPUs.

CI has no GPU, so the operation lists that afd_data.gpu_hop hands to CUDA streams are executed
here by a small machine: one "stream" per worker, every step replaying the same lists (as a
captured CUDA graph does, with its flag values baked in), and a random scheduler that advances
any stream whose next operation can run. Every row the FFN side computes on and every output the
attention side reads is checked against what must be there, so a slot overwritten too early, a
flag left set across a replay or a deadlock fails the test.
"""

from __future__ import annotations

import random

import pytest

from afd_ctl.routing import Role, peer_ranks
from afd_data.gpu_protocol import (
    POISON,
    READY,
    AttentionPeer,
    Compute,
    Copy,
    FlagLayout,
    GpuEndpoint,
    Loc,
    Wait,
    Write,
    attention_ops,
    choose_path,
    epoch_tag,
    ffn_ops,
    one_path,
)


class Machine:
    """M attention and N FFN streams over dict memories; rows are tuples naming their origin."""

    def __init__(self, m: int, n: int, layers: int, stages: int, slots_per_stage: int,
                 rows: list[int], router: bool, seed: int) -> None:  # fmt: skip
        self.m, self.n, self.layers, self.stages = m, n, layers, stages
        self.lif = slots_per_stage
        self.rows = rows  # per attention rank
        self.router = router
        self.rng = random.Random(seed)
        self.flags: dict[tuple, int] = {}
        self.mem: dict[tuple, dict[int, object]] = {}
        self.step = 0
        self.checked = 0
        self.ffn_peers = {a: peer_ranks(Role.ATTENTION, a, m, n) for a in range(m)}
        self.att_peers = {f: peer_ranks(Role.FFN, f, m, n) for f in range(n)}

    def slot(self, layer: int, stage: int) -> int:
        return stage * self.lif + layer % self.lif

    def blocks(self) -> list[tuple[int, int]]:
        return [(layer, stage) for layer in range(self.layers) for stage in range(self.stages)]

    def programs(self) -> dict[tuple[str, int], list[tuple[tuple[int, int], object]]]:
        """Per stream: its ops of one step, each tagged with its (layer, stage)."""
        progs: dict[tuple[str, int], list] = {}
        for a in range(self.m):
            progs[("attention", a)] = [
                ((layer, stage), op)
                for layer, stage in self.blocks()
                for op in attention_ops(
                    a, self.slot(layer, stage), self.rows[a], len(self.ffn_peers[a]), self.router
                )
            ]
        for f in range(self.n):
            peers, start = [], 0
            for a in self.att_peers[f]:
                peers.append(AttentionPeer(a, self.ffn_peers[a].index(f), start, self.rows[a]))
                start += self.rows[a]
            progs[("ffn", f)] = [
                ((layer, stage), op)
                for layer, stage in self.blocks()
                for op in ffn_ops(f, layer, stage, self.slot(layer, stage), peers, self.router)
            ]
        return progs

    # -- memory ---------------------------------------------------------------------------
    def _flag(self, loc: Loc) -> tuple:
        return (loc.owner, loc.rank, loc.area, loc.index)

    def _rows(self, loc: Loc) -> dict[int, object]:
        return self.mem.setdefault((loc.owner, loc.rank, loc.area, loc.index), {})

    def _input(self, rank: int, layer: int, stage: int, i: int, router: bool) -> tuple:
        return ("router" if router else "hidden", self.step, layer, stage, rank, i)

    def run_op(self, stream: tuple[str, int], block: tuple[int, int], op: object) -> bool:
        """Runs `op` if it can run now; False if it must wait."""
        layer, stage = block
        if isinstance(op, Wait):
            return self.flags.get(self._flag(op.flag), 0) >= op.value
        if isinstance(op, Write):
            self.flags[self._flag(op.flag)] = op.value
        elif isinstance(op, Copy):
            dst = self._rows(op.dst)
            if op.src.area == "input":
                for i in range(op.rows):
                    dst[op.dst.row + i] = self._input(op.src.rank, layer, stage, i, op.router)
            else:
                src = self._rows(op.src)
                for i in range(op.rows):
                    dst[op.dst.row + i] = src.get(op.src.row + i)
        elif isinstance(op, Compute):
            f = stream[1]
            slot = self.slot(layer, stage)
            hidden = self._rows(Loc("ffn", f, "recv_hidden", (slot,)))
            router = self._rows(Loc("ffn", f, "recv_router", (slot,)))
            out = self._rows(Loc("ffn", f, "out"))
            start = 0
            for a in self.att_peers[f]:
                for i in range(self.rows[a]):
                    want = self._input(a, layer, stage, i, False)
                    assert hidden.get(start + i) == want, (
                        f"ffn {f} step {self.step} layer {layer} stage {stage} row {start + i}: "
                        f"{hidden.get(start + i)} instead of {want}"
                    )
                    if self.router:
                        assert router.get(start + i) == self._input(a, layer, stage, i, True)
                    out[start + i] = ("out", f, want)
                    self.checked += 1
                start += self.rows[a]
        return True

    def check_outputs(self, a: int, layer: int, stage: int) -> None:
        slot = self.slot(layer, stage)
        for pos, f in enumerate(self.ffn_peers[a]):
            got = self._rows(Loc("attention", a, "recv_output", (slot, pos)))
            for i in range(self.rows[a]):
                want = ("out", f, self._input(a, layer, stage, i, False))
                assert got.get(i) == want, f"attention {a} got {got.get(i)} instead of {want}"
                self.checked += 1

    def run_step(self, stop_ffn_after: int | None = None, poison: bool = False) -> None:
        """One step: every stream replays its program once, in a random interleaving."""
        progs = self.programs()
        pc = dict.fromkeys(progs, 0)
        done_ops = 0
        while True:
            runnable = []
            for stream, prog in progs.items():
                if pc[stream] >= len(prog):
                    continue
                if stream[0] == "ffn" and stop_ffn_after is not None and done_ops >= stop_ffn_after:
                    continue  # the FFN worker died: its stream runs no more
                block, op = prog[pc[stream]]
                if not isinstance(op, Wait) or self.run_op(stream, block, op):
                    runnable.append(stream)
            if not runnable:
                if all(pc[s] >= len(p) for s, p in progs.items() if s[0] == "attention"):
                    break
                if poison:  # the host watchdog: POISON every flag the attention streams wait on
                    for a in range(self.m):
                        layout = FlagLayout(self.lif * self.stages, len(self.ffn_peers[a]))
                        for area, index in layout.flags_waited_on():
                            self.flags[("attention", a, area, index)] = POISON
                    continue
                raise AssertionError(f"deadlock at step {self.step}: {pc}")
            stream = self.rng.choice(runnable)
            block, op = progs[stream][pc[stream]]
            assert self.run_op(stream, block, op)
            pc[stream] += 1
            done_ops += 1
            nxt = progs[stream][pc[stream]] if pc[stream] < len(progs[stream]) else None
            if stream[0] == "attention" and not poison and (nxt is None or nxt[0] != block):
                self.check_outputs(stream[1], *block)  # the block's outputs are in: read them
        self.step += 1


@pytest.mark.parametrize(
    "m,n,stages,lif,router",
    [(1, 1, 1, 1, False), (1, 1, 2, 1, True), (2, 1, 1, 2, False), (1, 2, 1, 1, False),
     (2, 2, 2, 2, True), (3, 2, 1, 1, False)],
)  # fmt: skip
def test_replayed_steps_deliver_every_row_in_any_interleaving(m, n, stages, lif, router):
    for seed in range(6):
        machine = Machine(m, n, layers=4, stages=stages, slots_per_stage=lif,
                          rows=[3 + a for a in range(m)], router=router, seed=seed)  # fmt: skip
        for _ in range(5):  # the same lists replayed, as a captured graph is
            machine.run_step()
        assert machine.checked > 0
        # Every flag is back at 0 between steps: a replay never sees a stale READY.
        assert set(machine.flags.values()) <= {0}


def test_poison_releases_the_attention_stream_when_the_ffn_side_dies_mid_step():
    machine = Machine(1, 1, layers=4, stages=1, slots_per_stage=1, rows=[2], router=False, seed=1)
    machine.run_step()
    machine.run_step(stop_ffn_after=7, poison=True)  # it finishes instead of hanging
    assert machine.step == 2


def test_flag_layout_places_every_word_once():
    layout = FlagLayout(num_slots=4, num_ffn_peers=3)
    words = [layout.word(area, (s, p)) for area in ("hidden_ready", "output_ready")
             for s in range(4) for p in range(3)]  # fmt: skip
    words += [layout.word("drained", (p,)) for p in range(3)]
    assert sorted(words) == list(range(layout.words))
    with pytest.raises(IndexError):
        layout.word("hidden_ready", (4, 0))


def test_epoch_tags_are_never_zero_and_follow_the_epoch():
    for epoch in (0, 1, 0x7FFF_FFFE, 0x7FFF_FFFD, 1_764_600_000_000):
        assert 1 <= epoch_tag(epoch) <= 0x7FFF_FFFE
    assert epoch_tag(1_764_600_000_000) != epoch_tag(1_764_600_000_001)
    assert READY < POISON


def test_path_is_gpu_only_on_one_host_with_both_buffers_exportable():
    here = GpuEndpoint("boot-a", b"h" * 64, 0, 1024)
    there = GpuEndpoint("boot-b", b"h" * 64, 0, 1024)
    assert choose_path(here, GpuEndpoint("boot-a", b"x" * 64, 0, 1024), "auto").path == "gpu"
    assert choose_path(here, there, "auto").path == "nixl"
    assert "another host" in choose_path(here, there, "auto").reason
    assert choose_path(None, here, "auto").path == "nixl"
    assert choose_path(here, None, "auto").path == "nixl"
    assert choose_path(here, here, "off").path == "nixl"


def test_a_worker_whose_peers_need_different_paths_is_refused_naming_them():
    gpu, nixl = choose_path(GpuEndpoint("a", b"", 0, 0), GpuEndpoint("a", b"", 0, 0), "auto"), choose_path(None, None, "auto")  # fmt: skip
    assert one_path({0: gpu, 1: gpu}, "ffn rank 0").path == "gpu"
    with pytest.raises(ValueError, match=r"GPU-driven to ranks \[0\], NIXL to ranks \[1\]"):
        one_path({0: gpu, 1: nixl}, "ffn rank 0")


class _DriverCalls:
    """The two driver calls a flag can take, recorded (the GPU itself is not needed to see
    which one a setting picks)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def write(self, stream: int, addr: int, value: int, barrier: bool = True) -> None:
        self.calls.append(("cuStreamWriteValue32", stream, addr, value, barrier))

    def memset32(self, stream: int, addr: int, value: int, words: int) -> None:
        self.calls.append(("cuMemsetD32Async", stream, addr, value, words))


def test_flag_writes_follow_their_setting_and_a_bad_one_is_refused(monkeypatch) -> None:
    from afd_data.gpu_hop import write_flag
    from afd_data.gpu_protocol import flag_write_setting

    raise_flag = Write(Loc("ffn", 0, "hidden_ready", (0, 0)), READY)
    reset = Write(Loc("ffn", 0, "hidden_ready", (0, 0)), 0, barrier=False)
    monkeypatch.delenv("AFD_DATA_GPU_FLAG_WRITES", raising=False)
    assert flag_write_setting() == "stream"
    cuda = _DriverCalls()
    for how in ("stream", "memset"):
        monkeypatch.setenv("AFD_DATA_GPU_FLAG_WRITES", f" {how.upper()} ")
        assert flag_write_setting() == how
        write_flag(cuda, 7, 0x1000, raise_flag, how)
        write_flag(cuda, 7, 0x1004, reset, how)
    assert cuda.calls == [
        ("cuStreamWriteValue32", 7, 0x1000, READY, True),
        ("cuStreamWriteValue32", 7, 0x1004, 0, False),
        ("cuMemsetD32Async", 7, 0x1000, READY, 1),
        ("cuMemsetD32Async", 7, 0x1004, 0, 1),
    ]
    monkeypatch.setenv("AFD_DATA_GPU_FLAG_WRITES", "kernel")
    with pytest.raises(
        ValueError, match="AFD_DATA_GPU_FLAG_WRITES='kernel': expected one of stream, memset"
    ):
        flag_write_setting()
