"""What each kind of stream operation of the GPU-driven hop costs inside a CUDA graph, on one GPU.

The hop's round trip (benchmarks/gpu_driven_hop.py: 18-20 µs on one H100 or H200 under MPS) is
a chain of stream operations (afd_data.gpu_protocol): per layer three copies
(`cuMemcpyDtoDAsync`: the attention side into its send slot, the FFN side pulling it, the FFN
side pushing its output back), the attention side's `copy_` of the output (torch sends a
contiguous same-dtype copy to `cudaMemcpyAsync` too: a fourth copy), four
`cuStreamWriteValue32` (two flags raised, two reset; each with the memory barrier, the only kind
the H200 driver takes) and two `cuStreamWaitValue32`, plus the crossing between the processes.
This times each kind alone, `--ops` of it back to back in one captured graph, so the chain's
budget can be split before anything in it is changed:

- `write`: a flag word written (with the barrier);
- `wait_met`: a wait on a word that already holds its value (what a wait costs when nothing is
  late);
- `write_wait`: a write and then a wait on that word (one handover within a stream);
- `memcpy_{rows}`: `cuMemcpyDtoDAsync` of `rows` x `--hidden` bf16;
- `torch_copy_{rows}`: torch's `copy_` of the same bytes (the hop's own last copy);
- `copy_kernel_{rows}`: the same bytes through a kernel (`torch.mul(src, 1, out=dst)`), what a
  copy done by the SMs instead would cost;
- `tiny_kernel`: the smallest kernel (one element), a graph node's floor;
- what could replace a flag write (benchmarks/hop_kernels.py): `memset_flag` (a one-word
  `cuMemsetD32Async`), `fill_flag` (torch's `fill_` of the word: a kernel), `store_flag` (a
  Triton kernel's system-scope release store); and per size the copy with its flag as today
  (`memcpy_write_{rows}`: `cuMemcpyDtoDAsync` then `cuStreamWriteValue32`), as a copy then a
  kernel (`memcpy_fill_{rows}`), and as one Triton kernel (`copy_then_flag_{rows}`).

A kind that fails (a driver that refuses an operation in a graph, no Triton) is reported as
`{name}_error` and the others are still timed.

Prints one JSON line last (µs per operation, the median over `--replays`).

    python benchmarks/gpu_hop_ops.py [--rows 16,128] [--hidden 7168] [--ops 200] [--mps]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def replay_us(graph: Any, per: int, replays: int) -> list[float]:
    """µs per each of the `per` operations a captured graph holds, one figure per replay timed
    with CUDA events (`replays` of them, after a first untimed one)."""
    import torch

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays + 1):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / per)
    return times[1:]


def per_op_us(enqueue: Callable[[], None], ops: int, replays: int) -> float:
    """The median time of one operation: `enqueue` issues one, `ops` of them are captured in a
    graph, and each replay is timed (`replay_us`)."""
    import torch

    enqueue()  # lazy initialisations (cuBLAS, allocator) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            enqueue()
    return statistics.median(replay_us(graph, ops, replays))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from afd_data.cuda_driver import driver

    cuda = driver()
    torch.cuda.set_device("cuda:0")
    words = torch.zeros(64, dtype=torch.int32, device="cuda:0")
    flag = int(words.data_ptr())

    def stream() -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    def write_wait() -> None:
        cuda.write(stream(), flag + 4, 1)
        cuda.wait_geq(stream(), flag + 4, 1)

    def memset_wait() -> None:  # write_wait with the flag raised by a memset
        cuda.memset32(stream(), flag + 40, 1, 1)
        cuda.wait_geq(stream(), flag + 40, 1)

    one = torch.zeros(1, device="cuda:0")
    kinds: dict[str, Callable[[], None]] = {
        "write": lambda: cuda.write(stream(), flag, 1),
        "wait_met": lambda: cuda.wait_geq(stream(), flag + 8, 0),
        "write_wait": write_wait,
        "tiny_kernel": lambda: one.add_(1.0),
        "memset_flag": lambda: cuda.memset32(stream(), flag + 12, 1, 1),
        "memset_wait": memset_wait,
        "fill_flag": lambda: words[4:5].fill_(1),
        "store_flag": lambda: _kernels().store_flag(words[5:6], 1),
    }
    for rows in [int(r) for r in args.rows.split(",")]:
        src = torch.randn(rows, args.hidden, device="cuda:0", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        nbytes = src.numel() * src.element_size()

        def memcpy(s: Any = src, d: Any = dst, n: int = nbytes) -> None:
            cuda.copy(stream(), int(d.data_ptr()), int(s.data_ptr()), n)

        def memcpy_write(copy: Callable[[], None] = memcpy) -> None:
            copy()
            cuda.write(stream(), flag + 24, 1)

        def memcpy_fill(copy: Callable[[], None] = memcpy) -> None:
            copy()
            words[7:8].fill_(1)

        kinds[f"memcpy_{rows}"] = memcpy
        kinds[f"torch_copy_{rows}"] = lambda s=src, d=dst: d.copy_(s)
        kinds[f"copy_kernel_{rows}"] = lambda s=src, d=dst: torch.mul(s, 1, out=d)
        kinds[f"memcpy_write_{rows}"] = memcpy_write
        kinds[f"memcpy_fill_{rows}"] = memcpy_fill
        kinds[f"copy_then_flag_{rows}"] = lambda s=src, d=dst: _kernels().copy_then_flag(
            s, d, words[8:9], words[9:10], 1
        )
    result: dict[str, Any] = {
        "benchmark": "gpu_hop_ops",
        "device": torch.cuda.get_device_name(0),
        "mps": args.mps,
        "hidden": args.hidden,
        "rows": args.rows,
        "ops_per_graph": args.ops,
        "replays": args.replays,
    }
    for name, enqueue in kinds.items():
        try:
            result[f"{name}_us"] = round(per_op_us(enqueue, args.ops, args.replays), 2)
        except Exception as exc:  # one kind's failure must not lose the others' figures
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # a failed capture can leave the stream unusable
                result[f"{name}_error"] += f"; then synchronize: {sync_exc}"[:200]
                break
    return result


def _kernels() -> Any:
    """benchmarks/hop_kernels.py, imported when first used (it needs Triton)."""
    from benchmarks import hop_kernels

    return hop_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,128", help="copy sizes: rows of --hidden bf16")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ops", type=int, default=200, help="operations per captured graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--mps", action="store_true", help="MPS was started for this run")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_hop_ops", "skipped": "needs CUDA"}))
        return
    print(json.dumps(measure(args)), flush=True)


if __name__ == "__main__":
    main()
