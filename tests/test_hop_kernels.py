"""The candidate flag kernels of benchmarks/hop_kernels.py (timed on a GPU by gpu_hop_ops.py),
run by Triton's interpreter on the CPU: each copy arrives whole, the flag holds its value, and
the done-counter is back at 0 for the next replay, launch after launch (as a graph replays).
The interpreter runs a launch's programs one after another: results, not memory ordering."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from benchmarks import hop_kernels
    out = []
    words = torch.zeros(4, dtype=torch.int32)
    for rows in (1, 16, 3):  # one program (1 x 1000), several, a last block cut short
        src = torch.randn(rows, 1000 if rows == 1 else 7168).to(torch.bfloat16)
        dst = torch.zeros_like(src)
        words[0] = 0
        hop_kernels.copy_then_flag(src, dst, words[0:], words[1:], 5 + rows)
        out.append([torch.equal(src, dst), words[0].item(), words[1].item()])
    hop_kernels.store_flag(words[2:], 9)
    out.append(words.tolist())
    print(json.dumps(out))
    """
)


def test_copy_then_flag_and_store_flag_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton (here through vLLM's xgrammar) runs the kernels")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "[[true, 6, 0], [true, 21, 0], [true, 8, 0], [8, 0, 9, 0]]", done.stdout
