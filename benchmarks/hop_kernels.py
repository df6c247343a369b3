"""Candidate kernels for the GPU-driven hop's flag writes, timed by benchmarks/gpu_hop_ops.py.

A flag write in the hop today is a `cuStreamWriteValue32` with its memory barrier (the only kind
the H200 driver takes): 1.96 µs in a captured graph on one H100, twice a small kernel's 1.00
µs, and a layer's hop has four of them (two raised, two reset) beside four copies (README,
2026-12-07 twelfth session).
These are what could replace them, measured before anything in afd_data changes:

- `copy_then_flag`: the rows copied by the SMs and then the flag raised, in one kernel: every
  program copies its block, then counts itself done (acquire-release at GPU scope, after a
  barrier so its threads' stores precede the count); the last one resets the counter for the
  next replay and stores the flag with a system-scope release, so a peer that sees the flag
  (another process or GPU polling it with `cuStreamWaitValue32`) sees the rows.
- `store_flag`: the flag alone, as a one-program kernel with the same release store.

Both run under Triton's interpreter on the CPU too (TRITON_INTERPRET=1), which is how the CPU
suite checks what they write (tests/test_hop_kernels.py); the interpreter runs the programs one
after another, so that checks the results, not the memory ordering. The ordering is meant for
one GPU (the counter at GPU scope); a peer GPU as `dst` would want the count at system scope.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

BLOCK = 4096  # elements per program


@triton.jit
def _copy_then_flag(src, dst, n, flag, counter, value, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag, value, sem="release", scope="sys")


@triton.jit
def _store_flag(flag, value):
    tl.atomic_xchg(flag, value, sem="release", scope="sys")


def copy_then_flag(src: Any, dst: Any, flag: Any, counter: Any, value: int) -> None:
    """Copies `src` into `dst` (same shape and dtype, contiguous), then sets the int32 word
    `flag` to `value`. `counter`: an int32 word holding 0, left at 0 (one per call site: two
    launches in flight at once must not share it)."""
    n = src.numel()
    programs = max(1, triton.cdiv(n, BLOCK))  # one program raises the flag even for no rows
    _copy_then_flag[(programs,)](src, dst, n, flag, counter, value, BLOCK=BLOCK)


def store_flag(flag: Any, value: int) -> None:
    """Sets the int32 word `flag` to `value` with a system-scope release store."""
    _store_flag[(1,)](flag, value)
