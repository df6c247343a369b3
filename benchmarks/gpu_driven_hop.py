"""The GPU-driven hop of the data plane (afd_data.gpu_hop through vllm_ext.exchange.gpu), measured
between two real worker processes: an attention side (cuda:0) and an FFN side (cuda:1, or
cuda:0 with --one-gpu), each with its real NixlTransport and GpuHop, connected as the
rendezvous would connect them (blobs exchanged as base64 JSON lines on the child's stdin and
stdout). The FFN side's "compute" is x * 2, so every output row is checked.

- host-synced: the attention host enqueues one round trip and waits for it (an event's
  synchronize): p50/p99;
- graph: `--layers` round trips captured in one CUDA graph on the attention side (as vLLM's
  FULL decode graph holds them), replayed `--replays` times, timed with CUDA events; the FFN
  side replays one graph of every layer too (as the vLLM FFN server launches a step;
  `--ffn-eager`: it enqueues each layer from its host instead): the round trip with no host
  in the loop.

`--work-mib N` gives every layer's FFN compute a bandwidth-bound GEMM too (the rows times an
N MiB bf16 weight, as an expert's decode GEMM is), and times the same kernels in one process
without the exchange (`work_alone_per_layer_us`): `graph_added_per_layer_us` is then what the
hop adds to a layer whose FFN work is real (on one GPU under MPS, the exchange beside a kernel
that wants the whole memory bandwidth), not to an empty one.

Prints one JSON line last. `--mps` records that the command started MPS (one GPU, both sides
running concurrently).

    python benchmarks/gpu_driven_hop.py [--rows 128] [--hidden 7168] [--one-gpu] [--mps]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_hop_ops import per_op_us, replay_us  # noqa: E402


def _transport(role: str, device: str, args: argparse.Namespace) -> Any:
    from afd_data import NixlTransport, TransportConfig
    from afd_data.gpu_hop import GpuHop

    # AFD_DATA_GPU_FLAG_RESETS (both processes) picks how the flags meet (gpu_protocol.flag_use).
    config = TransportConfig.from_env(
        hidden_size=args.hidden, max_tokens_per_peer=args.rows, dtype="bfloat16",
        num_attention=1, num_ffn=1, recv_timeout_s=30.0, num_layers=args.layers,
    )  # fmt: skip
    transport = NixlTransport(f"hop-{role}-{time.time_ns()}", role, 0, config, device=device)
    hop = GpuHop(transport.role, 0, config, transport.layout, transport.local)
    return transport, hop


def _stream() -> int:
    import torch

    return int(torch.cuda.current_stream().cuda_stream)


def ffn_main(args: argparse.Namespace) -> None:
    import torch

    device = f"cuda:{args.ffn_device}"
    torch.cuda.set_device(device)
    transport, gpu = _transport("ffn", device, args)
    print(json.dumps({"blob": base64.b64encode(transport.blob()).decode()}), flush=True)
    peer = json.loads(sys.stdin.readline())
    transport.connect(1, [("attention", 0, 0, base64.b64decode(peer["blob"]))])
    gpu.connect(1, transport.peer_blobs(), 60.0)
    from afd_data.step_plan import plan_step

    slices = plan_step(transport.config, transport.role, 0, [[args.rows]]).slices[0]
    host_synced = args.iters + args.warmup
    total = host_synced + (args.replays + 1) * args.layers

    compute = _work(args, device)

    def layer(i: int) -> None:
        gpu.ffn_layer(i % args.layers, 0, slices, _stream(), compute)

    with torch.inference_mode():
        for i in range(host_synced):  # one layer at a time, enqueued from the host
            layer(i)
        if args.ffn_graph:  # as the vLLM FFN server runs a step: one graph of every layer
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for k in range(args.layers):
                    layer(host_synced + k)
            for _ in range(args.replays + 1):
                graph.replay()
        else:
            for i in range(host_synced, total):
                layer(i)
        torch.cuda.synchronize()
    print(json.dumps({"ffn_done": total, "ffn_graph": args.ffn_graph}), flush=True)
    gpu.close()
    transport.close()


def _work(args: argparse.Namespace, device: str) -> Any:
    """The FFN's compute of one layer: x * 2, after a GEMM of x with a `--work-mib` weight."""
    import torch

    if not args.work_mib:
        return lambda x, r: x * 2
    cols = max(1, args.work_mib * 2**20 // (args.hidden * 2))
    weight = torch.randn(args.hidden, cols, device=device, dtype=torch.bfloat16)
    scratch = torch.empty(args.rows, cols, device=device, dtype=torch.bfloat16)

    def compute(x: Any, router: Any) -> Any:
        torch.matmul(x, weight, out=scratch[: x.shape[0]])
        return x * 2

    return compute


def _json_line(stream: Any, key: str) -> dict[str, Any]:
    """The child's next JSON line holding `key` (libraries may print other lines first)."""
    for line in stream:
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if key in obj:
                return obj
    raise RuntimeError(f"the FFN side ended without a {key!r} line")


def attention_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.cuda.set_device("cuda:0")
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-ffn", *sys.argv[1:]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        transport, gpu = _transport("attention", "cuda:0", args)
        hello = _json_line(child.stdout, "blob")
        child.stdin.write(json.dumps({"blob": base64.b64encode(transport.blob()).decode()}) + "\n")
        child.stdin.flush()
        transport.connect(1, [("ffn", 0, 0, base64.b64decode(hello["blob"]))])
        gpu.connect(1, transport.peer_blobs(), 60.0)
        result: dict[str, Any] = {
            "benchmark": "gpu_driven_hop",
            "path": gpu.path,
            "flag_writes": gpu.flag_writes,  # AFD_DATA_GPU_FLAG_WRITES, both processes
            "flag_write_backs": gpu.flag_use(0).reset,  # False: bits (AFD_DATA_GPU_FLAG_RESETS)
            "gpus": 1 if args.one_gpu else 2,
            "mps": args.mps,
            "rows": args.rows,
            "hidden": args.hidden,
            "bytes_each_way": args.rows * args.hidden * 2,
        }
        hidden = torch.randn(args.rows, args.hidden, device="cuda:0").to(torch.bfloat16)
        out = torch.empty_like(hidden)
        samples = []
        with torch.inference_mode():
            for i in range(args.warmup + args.iters):
                t0 = time.perf_counter()
                gpu.send(i % args.layers, 0, hidden, None, _stream())
                gpu.take(i % args.layers, 0, out, _stream())
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
                if i >= args.warmup:
                    samples.append((time.perf_counter() - t0) * 1e6)
            ok = bool(torch.equal(out, hidden * 2))
            q = statistics.quantiles(samples, n=100)
            result.update(host_synced_rt_p50_us=round(q[49], 1), host_synced_rt_p99_us=round(q[98], 1),
                          host_synced_rows_ok=ok)  # fmt: skip
            # Graph mode: every layer's round trip inside one captured graph.
            out.zero_()
            graph = torch.cuda.CUDAGraph()
            start = args.warmup + args.iters
            with torch.cuda.graph(graph):
                for layer in range(args.layers):
                    gpu.send((start + layer) % args.layers, 0, hidden, None, _stream())
                    gpu.take((start + layer) % args.layers, 0, out, _stream())
            per_rt = replay_us(graph, args.layers, args.replays)
            result.update(
                graph_rt_p50_us=round(statistics.median(per_rt), 2),
                graph_rt_min_us=round(min(per_rt), 2),
                graph_layers_per_replay=args.layers,
                graph_replays=args.replays,
                graph_rows_ok=bool(torch.equal(out, hidden * 2)),
            )
            if args.work_mib:
                result.update(_work_alone(args, hidden, out, result["graph_rt_p50_us"]))
        done = _json_line(child.stdout, "ffn_done")
        result["ffn_served"] = done.get("ffn_done")
        result["ffn_side"] = "one graph per replay" if done.get("ffn_graph") else "eager per layer"
        gpu.close()
        transport.close()
        return result
    finally:
        child.wait(timeout=60) if child.poll() is None else None
        if child.poll() is None:
            child.kill()


def _work_alone(args: argparse.Namespace, hidden: Any, out: Any, rt_us: float) -> dict[str, Any]:
    """The FFN's compute of every layer in one process's graph, with no exchange (`per_op_us`
    warms it up, so cuBLAS makes its handle outside the capture)."""
    compute = _work(args, "cuda:0")
    alone = per_op_us(lambda: out.copy_(compute(hidden, None)), args.layers, args.replays)
    return {
        "work_mib": args.work_mib,
        "work_alone_per_layer_us": round(alone, 2),
        "graph_added_per_layer_us": round(rt_us - alone, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="128 x 7168 bf16 = 1.75 MiB")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--layers", type=int, default=61, help="round trips per graph")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--one-gpu", action="store_true", help="both sides on cuda:0")
    parser.add_argument(
        "--ffn-eager", dest="ffn_graph", action="store_false",
        help="graph mode: the FFN side enqueues each layer from its host instead of replaying "
        "one graph of every layer (as the vLLM FFN server does)",
    )  # fmt: skip
    parser.add_argument(
        "--work-mib", type=int, default=0,
        help="the FFN's compute per layer reads a weight of this many MiB (a GEMM), and the "
        "same compute is timed alone in one process (0: x * 2 only)",
    )  # fmt: skip
    parser.add_argument("--mps", action="store_true", help="MPS was started for this run")
    parser.add_argument("--serve-ffn", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() or (torch.cuda.device_count() < 2 and not args.one_gpu):
        print(
            json.dumps(
                {"benchmark": "gpu_driven_hop", "skipped": "needs CUDA (two GPUs or --one-gpu)"}
            )
        )
        return
    args.ffn_device = 0 if args.one_gpu else 1
    if args.serve_ffn:
        ffn_main(args)
        return
    result = attention_main(args)
    bad = [k for k in ("host_synced_rows_ok", "graph_rows_ok") if not result.get(k)]
    if result.get("path") != "gpu":
        bad.append("path")
    if bad:
        result["refused"] = f"not measured as asked: {bad}"
    print(json.dumps(result), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
