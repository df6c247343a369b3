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

Every received row is checked after each mode. Prints one JSON line last (a graph mode that
fails, e.g. a driver refusing stream memory operations in a capture, is reported in it, after
the host-synced figures).

A probe, not the transport: the two processes swap their tensors through torch.multiprocessing
queues (its CUDA IPC sharing). A data plane built on this would carry the IPC handles in its
protobuf registration blob.

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
        # A device-to-device copy on one stream only (torch's cross-device copy_ also makes
        # the other device's current stream wait, which a CUDA graph capture refuses).
        self._copy = self._symbol(lib, "cuMemcpyDtoDAsync", "_v2")
        self._copy.restype = ctypes.c_int
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

    @staticmethod
    def _symbol(lib: Any, name: str, suffix: str = "_v2") -> Any:
        for candidate in (f"{name}{suffix}", name):
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

    def copy(self, stream: Any, dst: Any, src: Any) -> None:
        nbytes = src.numel() * src.element_size()
        self._check(
            self._copy(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream),
            "cuMemcpyDtoDAsync",
        )

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} returned CUresult {result}")


def ffn_side(args: argparse.Namespace, to_attention: Any, from_attention: Any) -> None:
    """cuda:1 (cuda:0 with --one-gpu): wait for the rows, copy them back into the attention side's rows, raise its flag."""
    import torch

    here = args.ffn_device
    torch.cuda.set_device(here)
    ops = StreamMemOps()
    rows = torch.zeros(args.rows, args.hidden, dtype=torch.bfloat16, device=f"cuda:{here}")
    flag = torch.zeros(8, dtype=torch.int32, device=f"cuda:{here}")
    to_attention.put((rows, flag))
    peer_rows, peer_flag = from_attention.get(timeout=60)
    enable_peer_access(torch, here, 0)
    stream = torch.cuda.current_stream()

    def round_trip(value: int, mode: int) -> None:
        ops.wait(stream, flag.data_ptr(), value, mode)
        ops.copy(stream, peer_rows, rows)
        ops.write(stream, peer_flag.data_ptr(), value)

    # Host-synced mode: every round trip is queued at once; the stream waits for each.
    for k in range(1, args.iters + 1):
        round_trip(k, WAIT_GEQ)
    torch.cuda.synchronize()
    to_attention.put("host-synced done")
    if from_attention.get(timeout=60) != "graph":
        return
    rows.zero_()
    ops.write(stream, flag.data_ptr(), 0)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=capture):
            for i in range(1, args.graph_iters + 1):
                ops.wait(capture, flag.data_ptr(), i, WAIT_EQ)
                ops.copy(capture, peer_rows, rows)
                if i == args.graph_iters:
                    ops.write(capture, flag.data_ptr(), 0)  # own flag reset before the answer
                ops.write(capture, peer_flag.data_ptr(), i)
    except RuntimeError as exc:
        to_attention.put(f"ffn capture failed: {exc}")
        return
    to_attention.put("captured")
    for _ in range(args.replays):
        graph.replay()
    torch.cuda.synchronize()
    to_attention.put("graph done")


def enable_peer_access(torch: Any, here: int, peer: int) -> None:
    """Lets this process's GPU reach the peer's (torch enables peer access on its first
    cross-device copies, both ways), so the driver's copies and flag writes into the peer's
    mapped memory work. Nothing to do when both sides share one GPU."""
    if here == peer:
        return
    a = torch.zeros(1, device=f"cuda:{here}")
    b = torch.zeros(1, device=f"cuda:{peer}")
    b.copy_(a)
    a.copy_(b)
    torch.cuda.synchronize(here)
    torch.cuda.synchronize(peer)


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
    enable_peer_access(torch, 0, args.ffn_device)
    stream = torch.cuda.current_stream()
    nbytes = rows.numel() * rows.element_size()

    # Host-synced: enqueue one round trip, wait for the stream.
    samples = []
    for k in range(1, args.iters + 1):
        t0 = time.perf_counter()
        ops.copy(stream, peer_rows, source)
        ops.write(stream, peer_flag.data_ptr(), k)
        ops.wait(stream, flag.data_ptr(), k, WAIT_GEQ)
        stream.synchronize()
        samples.append(time.perf_counter() - t0)
    assert to_attention.get(timeout=60) == "host-synced done"
    host_ok = bool(torch.equal(rows, source))
    warm = samples[len(samples) // 10 :]
    quantiles = statistics.quantiles([s * 1e6 for s in warm], n=100)

    result: dict[str, Any] = {
        "benchmark": "gpu_flag_hop",
        "gpus": 2 if args.ffn_device else 1,
        "rows": args.rows,
        "hidden": args.hidden,
        "bytes_each_way": nbytes,
        "host_synced_rt_p50_us": round(quantiles[49], 1),
        "host_synced_rt_p99_us": round(quantiles[98], 1),
        "host_synced_samples": len(warm),
        "host_synced_rows_ok": host_ok,
    }
    print(json.dumps(result), flush=True)
    try:
        result.update(graph_mode(args, torch, ops, rows, flag, source, peer_rows, peer_flag,
                                 to_attention, from_attention))  # fmt: skip
    except (RuntimeError, AssertionError) as exc:
        result["graph_error"] = str(exc)[:500]
    ffn.join(60)
    result["ffn_exit_code"] = ffn.exitcode
    return result


def graph_mode(args: argparse.Namespace, torch: Any, ops: StreamMemOps, rows: Any, flag: Any,
               source: Any, peer_rows: Any, peer_flag: Any, to_attention: Any,
               from_attention: Any) -> dict[str, Any]:  # fmt: skip
    """graph_iters round trips per replay, captured on each side; the round trip per replay."""
    stream = torch.cuda.current_stream()
    rows.zero_()
    ops.write(stream, flag.data_ptr(), 0)
    torch.cuda.synchronize()
    from_attention.put("graph")
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        for i in range(1, args.graph_iters + 1):
            ops.copy(capture, peer_rows, source)
            ops.write(capture, peer_flag.data_ptr(), i)
            ops.wait(capture, flag.data_ptr(), i, WAIT_EQ)
        ops.write(capture, flag.data_ptr(), 0)
    answer = to_attention.get(timeout=120)
    if answer != "captured":
        raise RuntimeError(answer)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_replay = []
    for _ in range(args.replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_replay.append(start.elapsed_time(end) * 1e3 / args.graph_iters)
    assert to_attention.get(timeout=120) == "graph done"
    warm = per_replay[len(per_replay) // 10 :] or per_replay
    return {
        "graph_rt_us": round(statistics.median(warm), 2),
        "graph_rt_min_us": round(min(warm), 2),
        "graph_iters_per_replay": args.graph_iters,
        "graph_replays": args.replays,
        "graph_rows_ok": bool(torch.equal(rows, source)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="128 x 7168 bf16 = 1.75 MiB")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--graph-iters", type=int, default=61, help="a step of DeepSeek-V3")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument(
        "--one-gpu", action="store_true",
        help="both sides on cuda:0: checks the mechanism (IPC, stream memory operations in a "
        "graph) where one GPU is lent; the two processes time-slice it, so no hop figure",
    )  # fmt: skip
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_flag_hop", "skipped": "needs CUDA GPUs"}))
        sys.exit(0)
    if torch.cuda.device_count() < 2 and not args.one_gpu:
        print(
            json.dumps(
                {"benchmark": "gpu_flag_hop", "skipped": "needs two CUDA GPUs (or --one-gpu)"}
            )
        )
        sys.exit(0)
    args.ffn_device = 0 if args.one_gpu else 1
    print(json.dumps(attention_side(args, mp.get_context("spawn"))), flush=True)


if __name__ == "__main__":
    main()
