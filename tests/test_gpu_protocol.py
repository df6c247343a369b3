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
    POISON_BIT,
    READY,
    RESETS,
    AttentionPeer,
    Compute,
    Copy,
    FlagLayout,
    FlagUse,
    GpuEndpoint,
    Loc,
    Wait,
    Write,
    attention_ops,
    choose_path,
    epoch_tag,
    ffn_ops,
    flag_use,
    met,
    one_path,
)


class Machine:
    """M attention and N FFN streams over dict memories; rows are tuples naming their origin.
    `resets`: TransportConfig.gpu_flag_resets ("auto": bits, where flag_use can)."""

    def __init__(self, m: int, n: int, layers: int, stages: int, slots_per_stage: int,
                 rows: list[int], router: bool, seed: int, resets: str = "each") -> None:  # fmt: skip
        self.m, self.n, self.layers, self.stages = m, n, layers, stages
        self.lif = slots_per_stage
        self.rows = rows  # per attention rank
        self.router = router
        self.resets = resets
        self.rng = random.Random(seed)
        self.flags: dict[tuple, int] = {}
        self.mem: dict[tuple, dict[int, object]] = {}
        self.step = 0  # steps run so far
        self.checked = 0
        self.ffn_peers = {a: peer_ranks(Role.ATTENTION, a, m, n) for a in range(m)}
        self.att_peers = {f: peer_ranks(Role.FFN, f, m, n) for f in range(n)}

    def slot(self, layer: int, stage: int) -> int:
        return stage * self.lif + layer % self.lif

    def use(self, layer: int) -> FlagUse:
        return flag_use(layer, self.layers, self.lif, self.resets)

    def blocks(self, steps: int) -> list[tuple[int, int, int]]:
        return [(self.step + k, layer, stage) for k in range(steps)
                for layer in range(self.layers) for stage in range(self.stages)]  # fmt: skip

    def programs(self, steps: int) -> dict[tuple[str, int], list[tuple[tuple, object]]]:
        """Per stream: its ops of `steps` steps in a row (the same lists each step, as a
        captured graph replays them), each tagged with its (step, layer, stage)."""
        progs: dict[tuple[str, int], list] = {}
        for a in range(self.m):
            progs[("attention", a)] = [
                ((step, layer, stage), op)
                for step, layer, stage in self.blocks(steps)
                for op in attention_ops(
                    a,
                    self.slot(layer, stage),
                    self.rows[a],
                    len(self.ffn_peers[a]),
                    self.router,
                    self.use(layer),
                )
            ]
        for f in range(self.n):
            peers, start = [], 0
            for a in self.att_peers[f]:
                peers.append(AttentionPeer(a, self.ffn_peers[a].index(f), start, self.rows[a]))
                start += self.rows[a]
            progs[("ffn", f)] = [
                ((step, layer, stage), op)
                for step, layer, stage in self.blocks(steps)
                for op in ffn_ops(
                    f, layer, stage, self.slot(layer, stage), peers, self.router, self.use(layer)
                )
            ]
        return progs

    # -- memory ---------------------------------------------------------------------------
    def _flag(self, loc: Loc) -> tuple:
        return (loc.owner, loc.rank, loc.area, loc.index)

    def _rows(self, loc: Loc) -> dict[int, object]:
        return self.mem.setdefault((loc.owner, loc.rank, loc.area, loc.index), {})

    @staticmethod
    def _input(step: int, rank: int, layer: int, stage: int, i: int, router: bool) -> tuple:
        return ("router" if router else "hidden", step, layer, stage, rank, i)

    def run_op(self, stream: tuple[str, int], block: tuple[int, int, int], op: object) -> bool:
        """Runs `op` if it can run now; False if it must wait."""
        step, layer, stage = block
        if isinstance(op, Wait):
            return met(self.flags.get(self._flag(op.flag), 0), op)
        if isinstance(op, Write):
            self.flags[self._flag(op.flag)] = op.value
        elif isinstance(op, Copy):
            dst = self._rows(op.dst)
            if op.src.area == "input":
                for i in range(op.rows):
                    dst[op.dst.row + i] = self._input(step, op.src.rank, layer, stage, i, op.router)
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
                    want = self._input(step, a, layer, stage, i, False)
                    assert hidden.get(start + i) == want, (
                        f"ffn {f} step {step} layer {layer} stage {stage} row {start + i}: "
                        f"{hidden.get(start + i)} instead of {want}"
                    )
                    if self.router:
                        assert router.get(start + i) == self._input(step, a, layer, stage, i, True)
                    out[start + i] = ("out", f, want)
                    self.checked += 1
                start += self.rows[a]
        return True

    def check_outputs(self, a: int, step: int, layer: int, stage: int) -> None:
        slot = self.slot(layer, stage)
        for pos, f in enumerate(self.ffn_peers[a]):
            got = self._rows(Loc("attention", a, "recv_output", (slot, pos)))
            for i in range(self.rows[a]):
                want = ("out", f, self._input(step, a, layer, stage, i, False))
                assert got.get(i) == want, f"attention {a} got {got.get(i)} instead of {want}"
                self.checked += 1

    def run_step(self, stop_ffn_after: int | None = None, poison: bool = False) -> None:
        self.run_steps(1, stop_ffn_after, poison)

    def run_steps(
        self, steps: int, stop_ffn_after: int | None = None, poison: bool = False
    ) -> None:
        """`steps` steps, every stream running on into the next step as soon as it can (a
        stream's next replay is queued behind its last), in a random interleaving."""
        progs = self.programs(steps)
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
                raise AssertionError(f"deadlock after step {self.step}: {pc}")
            stream = self.rng.choice(runnable)
            block, op = progs[stream][pc[stream]]
            assert self.run_op(stream, block, op)
            pc[stream] += 1
            done_ops += 1
            nxt = progs[stream][pc[stream]] if pc[stream] < len(progs[stream]) else None
            if stream[0] == "attention" and not poison and (nxt is None or nxt[0] != block):
                self.check_outputs(stream[1], *block)  # the block's outputs are in: read them
        self.step += steps


@pytest.mark.parametrize(
    "m,n,stages,lif,router",
    [(1, 1, 1, 1, False), (1, 1, 2, 1, True), (2, 1, 1, 2, False), (1, 2, 1, 1, False),
     (2, 2, 2, 2, True), (3, 2, 1, 1, False)],
)  # fmt: skip
@pytest.mark.parametrize("layers", [4, 5])
@pytest.mark.parametrize("resets", ["each", "auto"])
def test_replayed_steps_deliver_every_row_in_any_interleaving(m, n, stages, lif, router, layers,
                                                              resets):  # fmt: skip
    for seed in range(6):
        machine = Machine(m, n, layers=layers, stages=stages, slots_per_stage=lif,
                          rows=[3 + a for a in range(m)], router=router, seed=seed,
                          resets=resets)  # fmt: skip
        machine.run_steps(3)  # the same lists replayed, each stream running ahead
        for _ in range(2):  # and with every stream at a step boundary in between
            machine.run_step()
        assert machine.checked > 0
        if resets == "each":  # every flag is back at 0 between steps
            assert set(machine.flags.values()) <= {0}


def test_flags_meet_without_write_backs_where_every_slot_is_used_twice_a_step():
    for lif in (1, 2, 3):
        for layers in range(1, 10):
            uses = [flag_use(layer, layers, lif) for layer in range(layers)]
            if layers < 2 * lif:  # a slot used once a step: its flag would look met already
                assert uses == [RESETS] * layers
                continue
            assert not any(u.reset for u in uses)
            for slot in range(lif):
                bits = [u.value for layer, u in enumerate(uses) if layer % lif == slot]
                # Each use differs from the one before it, the next step's first included.
                assert all(b != a for a, b in zip(bits, bits[1:] + bits[:1], strict=True))
                assert all(b & POISON and not b & POISON_BIT for b in bits)
    assert flag_use(3, 8, 1, "each") == RESETS
    assert flag_use(0, 0, 1) == RESETS  # the layers not known
    with pytest.raises(ValueError, match="layer 8 outside the model's 8 layers"):
        flag_use(8, 8, 1)


def test_a_wait_met_by_a_stale_bit_is_impossible_and_poison_meets_every_wait():
    flag = Loc("attention", 0, "output_ready", (0, 0))
    for layer in range(5):
        use = flag_use(layer, 5, 1)
        (wait,) = use.meet(flag)
        previous = flag_use((layer - 1) % 5, 5, 1).value
        assert met(use.value, wait) and not met(previous, wait) and not met(0, wait)
        assert met(POISON, wait)
    wait, write_back = RESETS.meet(flag)
    assert met(READY, wait) and met(POISON, wait) and not met(0, wait)
    assert write_back == Write(flag, 0, barrier=False)


def test_poison_releases_the_attention_stream_when_the_ffn_side_dies_mid_step():
    for resets in ("each", "auto"):
        machine = Machine(1, 1, layers=4, stages=1, slots_per_stage=1, rows=[2], router=False,
                          seed=1, resets=resets)  # fmt: skip
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
    from afd_data.cuda_driver import write_flag
    from afd_data.gpu_protocol import flag_write_setting

    raise_flag = Write(Loc("ffn", 0, "hidden_ready", (0, 0)), READY)
    reset = Write(Loc("ffn", 0, "hidden_ready", (0, 0)), 0, barrier=False)
    monkeypatch.delenv("AFD_DATA_GPU_FLAG_WRITES", raising=False)
    assert flag_write_setting() == "stream"
    cuda = _DriverCalls()
    for how in ("stream", "memset"):
        monkeypatch.setenv("AFD_DATA_GPU_FLAG_WRITES", f" {how.upper()} ")
        assert flag_write_setting() == how
        write_flag(cuda, 7, 0x1000, raise_flag.value, raise_flag.barrier, how)
        write_flag(cuda, 7, 0x1004, reset.value, reset.barrier, how)
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
