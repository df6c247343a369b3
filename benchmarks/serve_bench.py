"""`vllm bench serve` (random dataset) against an AFD server and a colocated one: what users of
the reference AFD plugin compare (request and output-token throughput, TTFT, TPOT, ITL).

Each part starts its servers, runs `vllm bench serve` once per --concurrency, saves vLLM's own
result JSON per run, and stops its servers:

- `colocated_1gpu`: one `vllm serve` (on GPU: cuda:0);
- `afd`: `afd-ctl serve`, an FFN server (on GPU: cuda:1) and an attention server (cuda:0),
  1 attention : 1 FFN.

CPU (default): the tiny DeepSeek-V2 at a small load, both parts in one run. That checks the
script end to end on a machine without a GPU; its figures are not a speed claim.

    python benchmarks/serve_bench.py [--parts colocated_1gpu,afd]

GPU: the DeepSeek-V3-shaped model of benchmarks/e2e_decode.py (dummy weights, bf16, CUDA
graphs), by default 512 prompts of 1024 tokens in and 128 out, at concurrency 32 and 128. A
part takes minutes, so each can run in its own call and adds its figures to --state:

    python benchmarks/serve_bench.py --gpu --parts colocated_1gpu --state S.json
    python benchmarks/serve_bench.py --gpu --parts afd --state S.json

Prints one JSON line last: per concurrency, each part's figures and AFD's ratios against
colocated on one GPU (throughput per GPU counts AFD's two GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_setup  # noqa: E402
from tests.procs import Daemon, Proc, stop_children_on_sigterm  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    ffn_argv,
    free_port,
    serve_argv,
    vllm_env,
    wait_http_ok,
)
from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek  # noqa: E402

PARTS = ("colocated_1gpu", "afd")
GPUS = {"colocated_1gpu": 1, "afd": 2}
# What each run keeps of vLLM's result JSON.
METRICS = (
    "completed", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
    "p99_itl_ms",
)  # fmt: skip


def vllm_cli(*args: str) -> list[str]:
    """vLLM's command line through this interpreter (the GPU machines have no `vllm` script
    on PATH for a PYTHONPATH install)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", *args]


def gpu_engine_flags(args: argparse.Namespace, memory: float | None = None) -> list[str]:
    return [
        "--dtype", "bfloat16", "--load-format", "dummy",
        "--max-model-len", str(args.input_len + args.output_len + 64),
        "--max-num-seqs", str(max(args.concurrency)),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--gpu-memory-utilization", str(memory or args.gpu_memory), "--seed", "0",
    ]  # fmt: skip


def start_part(
    part: str, model: Path, tmp: Path, args: argparse.Namespace, procs: list[Proc]
) -> str:
    """Starts the part's servers; the API's base URL once /health answers."""
    port = free_port()
    afd: list[str] = []
    # The attention (or colocated) server on cuda:0, the FFN server on cuda:1; both visible.
    main_gpus, ffn_gpus = ("0", "0") if args.one_gpu else ("0,1", "1,0")
    main_memory = None
    if part == "afd":
        daemon = Daemon(tmp / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
        procs.append(daemon)
        afd = ["--afd-role", "attention", "--afd-controller", daemon.address]
        if args.gpu:
            ffn_memory = gpu_setup.ONE_GPU.ffn_memory if args.one_gpu else None
            ffn = vllm_cli("serve", str(model), "--afd-role", "ffn", "--afd-controller",
                           daemon.address, *gpu_engine_flags(args, ffn_memory))  # fmt: skip
            procs.append(
                Proc(ffn, tmp / "ffn.log", gpu_setup.gpu_env(ffn_gpus, gpu_setup.plugin_path(tmp)))
            )
        else:
            procs.append(Proc(ffn_argv(model, daemon.address), tmp / "ffn.log", vllm_env()))
        if args.one_gpu:
            main_memory = gpu_setup.ONE_GPU.attention_memory
            afd += ["--kv-cache-memory-bytes", str(gpu_setup.ONE_GPU.kv_cache_bytes)]
    if args.gpu:
        argv = vllm_cli("serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                        *gpu_engine_flags(args, main_memory), *afd)  # fmt: skip
        env = gpu_setup.gpu_env(main_gpus, gpu_setup.plugin_path(tmp))
    else:
        argv = serve_argv(model, port, "--max-num-seqs", str(max(args.concurrency)), *afd)
        env = vllm_env()
    server = Proc(argv, tmp / f"{part}-server.log", env)
    procs.append(server)
    wait_http_ok(f"http://127.0.0.1:{port}/health", args.start_timeout, server.popen)
    return f"http://127.0.0.1:{port}"


def bench(
    base_url: str, model: Path, concurrency: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One `vllm bench serve` run; the figures of its result JSON."""
    name = f"bench-c{concurrency}.json"
    argv = vllm_cli(
        "bench", "serve", "--backend", "vllm", "--base-url", base_url,
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--seed", "0", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    )  # fmt: skip
    env = gpu_setup.gpu_env("0" if args.one_gpu else "0,1", "") if args.gpu else vllm_env()
    run = Proc(argv, out / f"bench-c{concurrency}.log", env)
    try:
        rc = run.wait(args.bench_timeout)
    finally:
        run.stop()
    result_file = out / name
    if rc != 0 or not result_file.is_file():
        raise RuntimeError(f"vllm bench serve exited {rc}:\n{run.tail(30)}")
    result = json.loads(result_file.read_text())
    if result.get("completed") != args.num_prompts:
        raise RuntimeError(
            f"vllm bench serve completed {result.get('completed')} of {args.num_prompts} "
            f"requests; see {result_file}"
        )
    return {k: round(result[k], 3) for k in METRICS if isinstance(result.get(k), (int, float))}


def run_part(part: str, args: argparse.Namespace, tmp: Path, out: Path) -> dict[str, Any]:
    if args.gpu:
        model = gpu_setup.write_v3_shaped(tmp / "model", args.layers)
    else:
        model = build_tiny_deepseek(tmp / "tiny-v2", version=2)
    started = time.monotonic()
    with gpu_setup.part_processes() as procs:
        base_url = start_part(part, model, tmp, args, procs)
        runs = {}
        for c in args.concurrency:
            runs[str(c)] = bench(base_url, model, c, args, out / part)
            print(f"{part} concurrency {c}: {json.dumps(runs[str(c)])}", file=sys.stderr)
    shared = args.gpu and args.one_gpu and part == "afd"
    return {
        "concurrency": runs,
        "wall_s": round(time.monotonic() - started, 1),
        "placement": gpu_setup.SHARED_PLACEMENT if shared else "own GPU(s)",
    }


def summary(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "serve_bench",
        "mode": "gpu" if args.gpu else "cpu",
        "model": f"deepseek-v3-shaped-{args.layers}-layers-dummy" if args.gpu else "tiny-v2",
        "dataset": f"random, {args.num_prompts} prompts, in {args.input_len}, "
        f"out {args.output_len}, ignore_eos",
        "parts_done": [p for p in PARTS if p in state],
    }
    gpus = dict(GPUS)
    if state.get("afd", {}).get("placement") == gpu_setup.SHARED_PLACEMENT:
        gpus["afd"] = 1  # both AFD servers on one GPU: a path check, not the comparison
        result["afd_on_one_gpu"] = True
    for c in args.concurrency:
        row: dict[str, Any] = {}
        for part in PARTS:
            figures = state.get(part, {}).get("concurrency", {}).get(str(c))
            if figures:
                row[part] = figures
                row[part]["output_throughput_per_gpu"] = round(
                    figures["output_throughput"] / gpus[part], 3
                )
        if len(row) == len(PARTS):
            afd, colocated = row["afd"], row["colocated_1gpu"]
            row["ratio_output_throughput_afd_vs_colocated_1gpu"] = round(
                afd["output_throughput"] / colocated["output_throughput"], 3
            )
            row["ratio_output_throughput_per_gpu_afd_vs_colocated_1gpu"] = round(
                afd["output_throughput_per_gpu"] / colocated["output_throughput_per_gpu"], 3
            )
            row["ratio_median_tpot_afd_vs_colocated_1gpu"] = round(
                afd["median_tpot_ms"] / colocated["median_tpot_ms"], 3
            )
        result[f"concurrency_{c}"] = row
    if not args.gpu:
        result["note"] = "CPU: checks the script end to end; not a speed figure"
    return result


def main() -> None:
    stop_children_on_sigterm()  # `timeout` must not leave servers holding the GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="DeepSeek-V3-shaped, two GPUs")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated")
    parser.add_argument("--state", default="", help="accumulate the parts' figures here")
    parser.add_argument("--out", default="", help="keep vLLM's result JSON and logs here")
    parser.add_argument("--concurrency", default="", help="default: 32,128 (GPU), 2,4 (CPU)")
    parser.add_argument("--num-prompts", type=int, default=0, help="default: 512 / 12")
    parser.add_argument("--input-len", type=int, default=0, help="default: 1024 / 32")
    parser.add_argument("--output-len", type=int, default=0, help="default: 128 / 8")
    parser.add_argument("--layers", type=int, default=4, help="GPU model's layers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory", type=float, default=0.85)
    parser.add_argument("--start-timeout", type=float, default=0, help="default: 420 / 240 s")
    parser.add_argument("--bench-timeout", type=float, default=480.0)
    parser.add_argument(
        "--one-gpu", action="store_true",
        help="GPU: AFD's two servers share cuda:0 (a check of the path where one GPU is lent; "
        "its figures are not the comparison)",
    )  # fmt: skip
    args = parser.parse_args()
    gpu = args.gpu
    args.concurrency = [
        int(c) for c in (args.concurrency or ("32,128" if gpu else "2,4")).split(",")
    ]
    args.num_prompts = args.num_prompts or (512 if gpu else 12)
    args.input_len = args.input_len or (1024 if gpu else 32)
    args.output_len = args.output_len or (128 if gpu else 8)
    args.start_timeout = args.start_timeout or (420.0 if gpu else 240.0)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")

    state_path = Path(args.state) if args.state else None
    state = json.loads(state_path.read_text()) if state_path and state_path.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="afd-serve-bench-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "out"
        for part in parts:
            (out / part).mkdir(parents=True, exist_ok=True)
            work = Path(tmp) / part
            work.mkdir()
            state[part] = run_part(part, args, work, out)
            if state_path:
                state_path.write_text(json.dumps(state))
    print(json.dumps(summary(state, args)), flush=True)


if __name__ == "__main__":
    main()
