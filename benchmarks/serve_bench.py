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

Each concurrency runs --repeats times (default 3 on GPU, 2 on CPU) against the same servers;
a part's figures are medians over the repeats, with the min/median/max of the output
throughput and the median TPOT, and AFD's ratios come from medians with their range.

What refuses a run (exit status 3, the reason on stderr and in {"refused": [...]}; none of its
figures is written, in --state or the JSON line): a request that did not complete; a time or
rate that is not positive; fewer output tokens than asked (the runs use --ignore-eos); an
output throughput that disagrees with vLLM's own token count and duration; a median above its
p99; more output tokens/s than the concurrency allows at the measured mean end-to-end latency
(+10%); a spread (max - min) / median of the output throughput or the median TPOT over the
repeats wider than --spread-bound (default 0.15 on GPU, 0.5 on the shared CPU machine).

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
from benchmarks.timing_stats import (  # noqa: E402
    SPREAD_BOUND_CPU,
    SPREAD_BOUND_GPU,
    BenchmarkRefused,
    Spread,
    bounded_spread,
    check_serve_run,
    ratio,
)
from vllm_ext.testing.processes import Daemon, Proc, stop_children_on_sigterm  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    ffn_argv,
    free_port,
    serve_argv,
    vllm_env,
    wait_http_ok,
)
from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek  # noqa: E402

PARTS = ("colocated_1gpu", "afd")
REFUSED_EXIT = 3
GPUS = {"colocated_1gpu": 1, "afd": 2}
# What each run keeps of vLLM's result JSON.
METRICS = (
    "completed", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
    "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip
# Figures whose spread over the repeats is reported and bounded.
SPREAD_METRICS = ("output_throughput", "median_tpot_ms")


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
    base_url: str, model: Path, concurrency: int, args: argparse.Namespace, out: Path, repeat: int
) -> dict[str, Any]:
    """One `vllm bench serve` run; the figures of its result JSON, checked."""
    name = f"bench-c{concurrency}-r{repeat}.json"
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
    run = Proc(argv, out / f"bench-c{concurrency}-r{repeat}.log", env)
    try:
        rc = run.wait(args.bench_timeout)
    finally:
        run.stop()
    result_file = out / name
    if rc != 0 or not result_file.is_file():
        raise RuntimeError(f"vllm bench serve exited {rc}:\n{run.tail(30)}")
    result = json.loads(result_file.read_text())
    what = f"concurrency {concurrency}, repeat {repeat} ({result_file})"
    check_serve_run(result, args.num_prompts, args.output_len, concurrency, what)
    return {k: result[k] for k in METRICS if isinstance(result.get(k), (int, float))}


def over_repeats(runs: list[dict[str, Any]], bound: float, what: str) -> dict[str, Any]:
    """Medians over the repeats of every figure, the spreads of SPREAD_METRICS (bounded)."""
    figures: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if key in r]
        if key in SPREAD_METRICS:
            spread = bounded_spread(values, bound, f"{what}: {key}")
            figures[f"{key}_spread"] = spread.as_dict()
        figures[key] = round(Spread.of(values).median, 3)
    figures["repeats"] = len(runs)
    return figures


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
            repeats = [bench(base_url, model, c, args, out / part, r) for r in range(args.repeats)]
            runs[str(c)] = over_repeats(repeats, args.spread_bound, f"{part}, concurrency {c}")
            print(f"{part} concurrency {c}: {json.dumps(runs[str(c)])}", file=sys.stderr)
    shared = args.gpu and args.one_gpu and part == "afd"
    return {
        "concurrency": runs,
        "wall_s": round(time.monotonic() - started, 1),
        "placement": gpu_setup.SHARED_PLACEMENT if shared else "own GPU(s)",
    }


def spread_of(d: dict[str, float]) -> Spread:
    return Spread(d["min"], d["median"], d["max"], int(d["n"]))


def summary(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "serve_bench",
        "mode": "gpu" if args.gpu else "cpu",
        "model": f"deepseek-v3-shaped-{args.layers}-layers-dummy" if args.gpu else "tiny-v2",
        "dataset": f"random, {args.num_prompts} prompts, in {args.input_len}, "
        f"out {args.output_len}, ignore_eos",
        "parts_done": [p for p in PARTS if p in state],
        "repeats": args.repeats,
        "spread_bound": args.spread_bound,
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
            for key, name in (("output_throughput", "output_throughput"),
                              ("median_tpot_ms", "median_tpot")):  # fmt: skip
                if f"{key}_spread" in afd and f"{key}_spread" in colocated:
                    r = ratio(*(spread_of(f[f"{key}_spread"]) for f in (afd, colocated)))
                    row[f"ratio_{name}_afd_vs_colocated_1gpu"] = round(r.value, 3)
                    row[f"ratio_{name}_afd_vs_colocated_1gpu_range"] = [
                        round(r.low, 3), round(r.high, 3)
                    ]  # fmt: skip
                else:  # a state file from before the repeats
                    row[f"ratio_{name}_afd_vs_colocated_1gpu"] = round(afd[key] / colocated[key], 3)
            row["ratio_output_throughput_per_gpu_afd_vs_colocated_1gpu"] = round(
                afd["output_throughput_per_gpu"] / colocated["output_throughput_per_gpu"], 3
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
    parser.add_argument("--repeats", type=int, default=0, help="per concurrency (default 3 / 2)")
    parser.add_argument(
        "--spread-bound", type=float, default=0.0,
        help=f"widest (max - min) / median over repeats (default {SPREAD_BOUND_GPU} on GPU, "
        f"{SPREAD_BOUND_CPU} on CPU)",
    )  # fmt: skip
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
    args.repeats = args.repeats or (3 if gpu else 2)
    args.spread_bound = args.spread_bound or (SPREAD_BOUND_GPU if gpu else SPREAD_BOUND_CPU)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")

    state_path = Path(args.state) if args.state else None
    state = json.loads(state_path.read_text()) if state_path and state_path.is_file() else {}
    refused: list[str] = []
    with tempfile.TemporaryDirectory(prefix="afd-serve-bench-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "out"
        for part in parts:
            (out / part).mkdir(parents=True, exist_ok=True)
            work = Path(tmp) / part
            work.mkdir()
            try:
                state[part] = run_part(part, args, work, out)
            except BenchmarkRefused as exc:  # its reason is kept, none of its figures
                refused.append(f"{part}: {exc}")
                state.pop(part, None)
                print(f"refused: {part}: {exc}", file=sys.stderr, flush=True)
            if state_path:
                state_path.write_text(json.dumps(state))
    result = summary(state, args)
    if refused:
        head = {k: result[k] for k in ("benchmark", "mode", "model", "dataset", "repeats",
                                        "spread_bound")}  # fmt: skip
        print(json.dumps({**head, "refused": refused}), flush=True)
        sys.exit(REFUSED_EXIT)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
