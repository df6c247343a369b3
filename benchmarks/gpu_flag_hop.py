"""A probe for the GPU-driven hop (the GPU-speed issue's stretch): a layer's round trip between
two GPUs of one host with no host in the loop, measured against the NIXL hop of
benchmarks/data_plane.py.

The mechanism, with nothing but torch and the CUDA driver's stream memory operations:
- each process allocates its receive rows and a flag word on its own GPU and hands them to the
  other through CUDA IPC (torch.multiprocessing shares CUDA tensors that way), so each side
  holds the peer's buffer mapped into its own address space;
- a send is a peer copy into the peer's rows, then `cuStreamWriteValue32` of the step's number
  into the peer's flag, both on the sender's stream (the write carries a memory barrier, so
  the rows land before the flag);
- a receive is `cuStreamWaitValue32` on the local flag: the receiver's *stream* waits, not its
  host, so the work after it can already be queued (and captured in a CUDA graph).

"attention" (cuda:0) sends `--rows` x `--hidden` bf16 rows, "ffn" (cuda:1) waits for them,
copies them back (its "compute") and raises the attention side's flag; the attention side's
stream waits for that. Two modes:
- host-synced: the attention host enqueues one round trip and waits for its stream (as the
  host-driven NIXL hop does), `--iters` times: p50/p99 per round trip;
- graph: `--graph-iters` round trips captured in one CUDA graph on each side (flag values
  baked in, compared for equality and reset by their owner at the end), replayed `--replays`
  times: the round trip the GPUs see with no host involvement at all.

Every received row is checked after each mode. Prints one JSON line last.

    python benchmarks/gpu_flag_hop.py [--rows 128] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from typing import Any

WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: with a memory barrier before the write


class StreamMemOps:
    """cuStreamWaitValue32 / cuStreamWriteValue32 from the CUDA driver, through ctypes."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = self._symbol(lib, "cuStreamWaitValue32")
        self._write = self._symbol(lib, "cuStreamWriteValue32")
        for fn in (self._wait, self._write):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    @staticmethod
    def _symbol(lib: Any, name: str) -> Any:
        for candidate in (f"{name}_v2", name):
            try:
                return getattr(lib, candidate)
            except AttributeError:
                continue
        raise RuntimeError(f"the CUDA driver has no {name}")

    def wait(self, stream: Any, addr: int, value: int, flags: int = WAIT_GEQ) -> None:
        self._check(self._wait(stream.cuda_stream, addr, value, flags), "cuStreamWaitValue32")

    def write(self, stream: Any, addr: int, value: int) -> None:
        self._check(
            self._write(stream.cuda_stream, addr, value, WRITE_DEFAULT), "cuStreamWriteValue32"
        )

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} returned CUresult {result}")


def ffn_side(args: argparse.Namespace, to_attention: Any, from_attention: Any) -> None:
    """cuda:1: wait for the rows, copy them back into the attention side's rows, raise its flag."""
    import torch

    torch.cuda.set_device(1)
    ops = StreamMemOps()
    rows = torch.zeros(args.rows, args.hidden, dtype=torch.bfloat16, device="cuda:1")
    flag = torch.zeros(8, dtype=torch.int32, device="cuda:1")
    to_attention.put((rows, flag))
    peer_rows, peer_flag = from_attention.get(timeout=60)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()

    def round_trip(value: int, mode: int) -> None:
        ops.wait(stream, flag.data_ptr(), value, mode)
        peer_rows.copy_(rows, non_blocking=True)
        ops.write(stream, peer_flag.data_ptr(), value)

    # Host-synced mode: every round trip is queued at once; the stream waits for each.
    for k in range(1, args.iters + 1):
        round_trip(k, WAIT_GEQ)
    torch.cuda.synchronize()
    to_attention.put("host-synced done")
    assert from_attention.get(timeout=60) == "graph"
    ops.write(stream, flag.data_ptr(), 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        for i in range(1, args.graph_iters + 1):
            ops.wait(capture, flag.data_ptr(), i, WAIT_EQ)
            peer_rows.copy_(rows, non_blocking=True)
            if i == args.graph_iters:
                ops.write(capture, flag.data_ptr(), 0)  # own flag reset before the last answer
            ops.write(capture, peer_flag.data_ptr(), i)
    to_attention.put("captured")
    for _ in range(args.replays):
        graph.replay()
    torch.cuda.synchronize()
    to_attention.put("graph done")


def attention_side(args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    import torch

    torch.cuda.set_device(0)
    ops = StreamMemOps()
    to_attention, from_attention = ctx.Queue(), ctx.Queue()
    ffn = ctx.Process(target=ffn_side, args=(args, to_attention, from_attention), daemon=True)
    ffn.start()
    rows = torch.zeros(args.rows, args.hidden, dtype=torch.bfloat16, device="cuda:0")
    flag = torch.zeros(8, dtype=torch.int32, device="cuda:0")
    source = torch.randn(args.rows, args.hidden, device="cuda:0").to(torch.bfloat16)
    peer_rows, peer_flag = to_attention.get(timeout=120)
    from_attention.put((rows, flag))
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    nbytes = rows.numel() * rows.element_size()

    # Host-synced: enqueue one round trip, wait for the stream.
    samples = []
    for k in range(1, args.iters + 1):
        t0 = time.perf_counter()
        peer_rows.copy_(source, non_blocking=True)
        ops.write(stream, peer_flag.data_ptr(), k)
        ops.wait(stream, flag.data_ptr(), k, WAIT_GEQ)
        stream.synchronize()
        samples.append(time.perf_counter() - t0)
    assert to_attention.get(timeout=60) == "host-synced done"
    host_ok = bool(torch.equal(rows, source))
    warm = samples[len(samples) // 10 :]
    quantiles = statistics.quantiles([s * 1e6 for s in warm], n=100)

    # Graph: graph_iters round trips per replay on each side.
    rows.zero_()
    ops.write(stream, flag.data_ptr(), 0)
    torch.cuda.synchronize()
    from_attention.put("graph")
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        for i in range(1, args.graph_iters + 1):
            peer_rows.copy_(source, non_blocking=True)
            ops.write(capture, peer_flag.data_ptr(), i)
            ops.wait(capture, flag.data_ptr(), i, WAIT_EQ)
        ops.write(capture, flag.data_ptr(), 0)
    assert to_attention.get(timeout=120) == "captured"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_replay = []
    for _ in range(args.replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_replay.append(start.elapsed_time(end) * 1e3 / args.graph_iters)
    assert to_attention.get(timeout=120) == "graph done"
    graph_ok = bool(torch.equal(rows, source))
    ffn.join(60)
    warm_graph = per_replay[len(per_replay) // 10 :] or per_replay
    return {
        "benchmark": "gpu_flag_hop",
        "rows": args.rows,
        "hidden": args.hidden,
        "bytes_each_way": nbytes,
        "host_synced_rt_p50_us": round(quantiles[49], 1),
        "host_synced_rt_p99_us": round(quantiles[98], 1),
        "host_synced_samples": len(warm),
        "host_synced_rows_ok": host_ok,
        "graph_rt_us": round(statistics.median(warm_graph), 2),
        "graph_rt_min_us": round(min(warm_graph), 2),
        "graph_iters_per_replay": args.graph_iters,
        "graph_replays": args.replays,
        "graph_rows_ok": graph_ok,
        "ffn_exit_code": ffn.exitcode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="128 x 7168 bf16 = 1.75 MiB")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--graph-iters", type=int, default=61, help="a step of DeepSeek-V3")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(json.dumps({"benchmark": "gpu_flag_hop", "skipped": "needs two CUDA GPUs"}))
        sys.exit(0)
    print(json.dumps(attention_side(args, mp.get_context("spawn"))), flush=True)


if __name__ == "__main__":
    main()
