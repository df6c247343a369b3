"""Time per output token (TPOT) of greedy decode: AFD 1 attention : 1 FFN vs colocated vLLM.

Same tiny DeepSeek-V2 weights, same dtype and threads, in one run. Colocated runs first (one
vLLM process), then afd-ctl + the FFN server + the attention side (two vLLM processes).
TPOT = (t(N tokens) - t(1 token)) / (N - 1), best of --repeats, per engine.

Where the added time goes, per decode step:
- `*_mlp_ms_per_step`: time inside the decoder layers' MLP/MoE modules on the attention side;
  colocated that is the FFN compute, under AFD it is the proxies' round trip to the FFN server.
- `ffn_compute_ms_per_step`, `ffn_recv_wait_ms_per_step`, `ffn_send_ms_per_step`: the FFN
  server's own split, medians over its steps (recv wait includes the attention side's
  attention compute).
- `afd_exchange_overhead_ms_per_step` = AFD round trip - FFN compute: transfers, notifications,
  copies into registered memory and the custom-op call, i.e. what AFD adds per step.
- Per layer (`*_us_per_layer`): the attention side staging and posting its rows
  (`attention_post`), the FFN compute and the FFN staging and posting the outputs
  (`ffn_post`), and what is left of the attention side's wait: the two notifications' flight
  and the polling that sees them (`hops`). `colocated_mlp_us_per_layer` is the same layer's
  MLP/MoE inside the colocated run.

    python benchmarks/e2e_decode.py [--quick]

GPU mode (two GPUs, vLLM with CUDA, dummy weights of a DeepSeek-V3-shaped model: hidden 7168,
MLA q_lora 1536 / kv_lora 512 / rope 64 / 128 heads, 256 routed experts top-8 with grouped
routing plus 1 shared, moe_intermediate 2048, the first layer dense, bf16, CUDA graphs on).
Decode TPOT at several batch sizes, each part in one engine:

    python benchmarks/e2e_decode.py --gpu --part colocated_1gpu --state S.json  # (a) cuda:0
    python benchmarks/e2e_decode.py --gpu --part afd --state S.json             # (b) 1:1
    python benchmarks/e2e_decode.py --gpu --part colocated_2gpu --state S.json  # (c) TP=2+EP
    python benchmarks/e2e_decode.py --gpu --part afd_dbo --state S.json         # (b) with DBO

`afd_dbo` is (b) with dual-batch overlap (`--enable-dbo`, vLLM's decode threshold of 32 rows:
smaller batches run as one micro-batch). `--one-gpu` puts AFD's two servers on cuda:0 (a
check of the path where only one GPU is lent; its figures are not the comparison).

Each part adds its figures to S.json (a part takes a few minutes, so each fits one call on a
machine with a per-command limit); once all three are there, the JSON line compares them.

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_setup import (  # noqa: E402
    ONE_GPU,
    SHARED_PLACEMENT,
    gpu_env,
    part_processes,
    plugin_path,
    write_v3_shaped,
)
from tests.procs import Daemon, Proc, stop_children_on_sigterm  # noqa: E402
from vllm_ext.testing.procs import ffn_argv, offline_argv, vllm_env  # noqa: E402
from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek  # noqa: E402

STATS_RE = re.compile(r"afd ffn \S+: stats (\{.*\})")
GPU_PARTS = ("colocated_1gpu", "afd", "afd_dbo", "colocated_2gpu")


def gpu_llm_kwargs(max_batch: int, memory: float) -> dict[str, Any]:
    return {
        "dtype": "bfloat16",
        "enforce_eager": False,
        "load_format": "dummy",
        "max_model_len": 1024,
        "max_num_seqs": max_batch,
        "max_num_batched_tokens": max(2048, max_batch * 16),
        "gpu_memory_utilization": memory,
        "seed": 0,
    }


def gpu_part(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Runs one part of the GPU comparison; returns its per-batch figures."""
    batches = [int(b) for b in args.batches.split(",")]
    model = write_v3_shaped(tmp / "model", args.layers)
    extra = plugin_path(tmp)
    kwargs = gpu_llm_kwargs(max(batches), args.gpu_memory)
    bench = [
        "--gpu", "--bench-decode", str(args.tokens), "--repeats", str(args.repeats),
        "--batches", args.batches,
    ]  # fmt: skip
    afd_part = args.part.startswith("afd")
    if args.part == "colocated_2gpu":
        if args.one_gpu:
            raise SystemExit("colocated_2gpu needs two GPUs; drop --one-gpu")
        kwargs.update(tensor_parallel_size=2, enable_expert_parallel=True)
    # Attention (or colocated) on cuda:0, the FFN server on cuda:1; both visible, for CUDA IPC.
    main_gpus, ffn_gpus = ("0", "0") if args.one_gpu else ("0,1", "1,0")
    with part_processes() as procs:
        if afd_part:
            ffn_memory = ONE_GPU.ffn_memory if args.one_gpu else args.gpu_memory
            daemon = Daemon(tmp / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
            procs.append(daemon)
            ffn_flags = [
                "--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", "1024",
                "--max-num-seqs", str(max(batches)),
                "--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"]),
                "--gpu-memory-utilization", str(ffn_memory),
            ]  # fmt: skip
            argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
                    "--afd-role", "ffn", "--afd-controller", daemon.address, *ffn_flags]  # fmt: skip
            procs.append(Proc(argv, tmp / "ffn.log", gpu_env(ffn_gpus, extra)))
            afd: dict[str, Any] = {"role": "attention", "controller": daemon.address}
            if args.part == "afd_dbo":  # dual-batch overlap from vLLM's decode threshold on
                kwargs["enable_dbo"] = True
            kwargs["additional_config"] = {"afd": afd}
            if args.one_gpu:
                kwargs.update(
                    gpu_memory_utilization=ONE_GPU.attention_memory,
                    kv_cache_memory_bytes=ONE_GPU.kv_cache_bytes,
                )
        main_proc = Proc(
            offline_argv(model, *bench, "--llm-kwargs", json.dumps(kwargs)),
            tmp / f"{args.part}.log",
            gpu_env(main_gpus, extra),
        )
        procs.append(main_proc)
        report = main_proc.json_report(timeout=args.timeout)
        report["placement"] = SHARED_PLACEMENT if args.one_gpu and afd_part else "own GPU(s)"
        if afd_part:
            main_proc.wait(120)  # its exit publishes stop: the FFN server logs its stats
            procs[1].wait(60)
            match = STATS_RE.search(procs[1].log())
            report["ffn_stats"] = json.loads(match.group(1)) if match else {}
    return report


def gpu_summary(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The comparison once the three parts are in: TPOT, tokens/s per GPU, the exchange's share."""
    result: dict[str, Any] = {
        "benchmark": "e2e_decode",
        "mode": "gpu",
        "model": f"deepseek-v3-shaped-{args.layers}-layers-dummy",
        "decode_tokens": args.tokens,
        "repeats": args.repeats,
        "parts_done": [p for p in GPU_PARTS if p in state],
    }
    gpus = {"colocated_1gpu": 1, "afd": 2, "afd_dbo": 2, "colocated_2gpu": 2}
    shared = [
        p for p in ("afd", "afd_dbo") if state.get(p, {}).get("placement") == SHARED_PLACEMENT
    ]
    if shared:  # both AFD servers on one GPU: tokens/s per GPU counts the one
        gpus.update(dict.fromkeys(shared, 1))
        result["afd_on_one_gpu"] = shared
    for batch in args.batches.split(","):
        row: dict[str, Any] = {}
        for part in GPU_PARTS:
            figures = state.get(part, {}).get("batches", {}).get(batch)
            if not figures:
                continue
            row[f"tpot_ms_{part}"] = round(figures["tpot_ms"], 3)
            row[f"tokens_per_s_per_gpu_{part}"] = round(
                figures["decode_tokens_per_s"] / gpus[part], 1
            )
            if part.startswith("afd") and "exchange_post_ms_per_step" in figures:
                exchange = (
                    figures["exchange_post_ms_per_step"] + figures["exchange_wait_ms_per_step"]
                )
                row[f"{part}_exchange_ms_per_step"] = round(exchange, 3)
                row[f"{part}_exchange_share_of_step"] = round(exchange / figures["tpot_ms"], 3)
        for part in ("afd", "afd_dbo"):
            if f"tpot_ms_{part}" in row and "tpot_ms_colocated_1gpu" in row:
                row[f"ratio_tpot_{part}_vs_colocated_1gpu"] = round(
                    row[f"tpot_ms_{part}"] / row["tpot_ms_colocated_1gpu"], 3
                )
        dbo_ids, afd_ids = (
            state.get(p, {}).get("batches", {}).get(batch, {}).get("token_ids")
            for p in ("afd_dbo", "afd")
        )
        if dbo_ids is not None and afd_ids is not None:  # same dummy weights in both runs
            row["identical_tokens_afd_dbo_vs_afd"] = dbo_ids == afd_ids
        if "tpot_ms_afd_dbo" in row and "tpot_ms_afd" in row:
            row["ratio_tpot_afd_dbo_vs_afd"] = round(row["tpot_ms_afd_dbo"] / row["tpot_ms_afd"], 3)
        if "tokens_per_s_per_gpu_afd" in row and "tokens_per_s_per_gpu_colocated_2gpu" in row:
            row["ratio_tokens_per_gpu_afd_vs_colocated_2gpu"] = round(
                row["tokens_per_s_per_gpu_afd"] / row["tokens_per_s_per_gpu_colocated_2gpu"], 3
            )
        result[f"batch_{batch}"] = row
    same = [r["identical_tokens_afd_dbo_vs_afd"] for k, r in result.items()
            if k.startswith("batch_") and "identical_tokens_afd_dbo_vs_afd" in r]  # fmt: skip
    if same:
        result["identical_tokens"] = all(same)
    ffn = state.get("afd", {}).get("ffn_stats", {})
    if ffn:
        result["ffn_compute_ms_median_all_steps"] = ffn.get("compute_ms_median")
    result["note"] = (
        "dummy weights: the FFN server's differ from the colocated ones (vLLM's dummy loader "
        "draws per module), so tokens are not compared; exchange = the attention side's own "
        "timers (post + wait until the output is back), so it includes the FFN compute"
    )
    return result


def main_gpu(args: argparse.Namespace) -> None:
    state_path = Path(args.state)
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    started = time.monotonic()
    if args.part:
        with tempfile.TemporaryDirectory(prefix="afd-e2e-gpu-") as tmp:
            state[args.part] = gpu_part(args, Path(tmp))
        state[args.part]["wall_s"] = round(time.monotonic() - started, 1)
        state_path.write_text(json.dumps(state))
    print(json.dumps(gpu_summary(state, args)), flush=True)


def main() -> None:
    stop_children_on_sigterm()  # `timeout` must not leave servers holding the GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 tokens, 2 repeats (< 5 min)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--version", type=int, default=2, choices=(2, 3))
    gpu = parser.add_argument_group("GPU mode")
    gpu.add_argument("--gpu", action="store_true", help="DeepSeek-V3-shaped, two GPUs")
    gpu.add_argument("--part", choices=GPU_PARTS, help="run this part (else: summarise state)")
    gpu.add_argument("--state", default="e2e_gpu_state.json", help="parts' figures accumulate here")
    gpu.add_argument("--batches", default="16,64,256")
    gpu.add_argument("--layers", type=int, default=4)
    gpu.add_argument("--gpu-memory", type=float, default=0.85)
    gpu.add_argument("--timeout", type=float, default=540.0, help="seconds for one part")
    gpu.add_argument(
        "--one-gpu", action="store_true",
        help="AFD's two servers share cuda:0 (a check of the path on a one-GPU machine, not a "
        "deployment: its figures are not the two-GPU comparison)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.gpu:
        if args.tokens == 128:
            args.tokens = 64
        main_gpu(args)
        return
    if args.quick:
        args.tokens, args.repeats = 32, 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="afd-e2e-") as tmp:
        out = Path(tmp)
        model = build_tiny_deepseek(out / "model", version=args.version)
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        bench = [
            "--bench-decode", str(args.tokens), "--repeats", str(args.repeats),
            "--batch", str(args.batch),
        ]  # fmt: skip
        env = vllm_env(in_process=True)
        colocated = Proc(offline_argv(model, *bench), out / "colocated.log", env)
        try:
            colo = colocated.json_report(timeout=600)
        finally:
            colocated.stop()

        daemon = Daemon(out / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
        ffn = Proc(ffn_argv(model, daemon.address), out / "ffn.log", vllm_env())
        attention = Proc(
            offline_argv(model, *bench, "--afd-controller", daemon.address),
            out / "attention.log",
            env,
        )
        try:
            afd = attention.json_report(timeout=600)
            ffn.wait(60)
            match = STATS_RE.search(ffn.log())
            ffn_stats = json.loads(match.group(1)) if match else {}
        except AssertionError:
            for p in (attention, ffn, daemon):
                print(f"--- {p.log_path.name}\n{p.tail(30)}", file=sys.stderr)
            raise
        finally:
            for p in (attention, ffn, daemon):
                p.stop()

    exchange = afd.get("afd_exchange", {})
    ffn_send = float(ffn_stats.get("send_ms_median", 0.0))
    # Medians over the FFN server's last 1000 steps: a typical decode step (the means also
    # count the memory-profiling run and the prefills).
    ffn_compute = float(ffn_stats.get("compute_ms_median", 0.0))
    result = {
        "benchmark": "e2e_decode",
        "model": f"tiny-deepseek-v{args.version}",
        "decode_tokens": args.tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "afd_tpot_ms": round(afd["tpot_ms"], 3),
        "colocated_tpot_ms": round(colo["tpot_ms"], 3),
        "ratio_tpot_afd_vs_colocated": round(afd["tpot_ms"] / colo["tpot_ms"], 3),
        "identical_tokens": afd["token_ids"] == colo["token_ids"],
        "colocated_mlp_ms_per_step": round(colo["mlp_ms_per_step"], 3),
        "afd_mlp_roundtrip_ms_per_step": round(afd["mlp_ms_per_step"], 3),
        "ffn_compute_ms_per_step": round(ffn_compute, 3),
        "ffn_recv_wait_ms_per_step": round(float(ffn_stats.get("recv_wait_ms_median", 0)), 3),
        "ffn_send_ms_per_step": round(float(ffn_stats.get("send_ms_median", 0)), 3),
        "afd_exchange_overhead_ms_per_step": round(afd["mlp_ms_per_step"] - ffn_compute, 3),
        "ffn_steps_served": ffn_stats.get("steps"),
        "colocated_mlp_us_per_layer": round(1e3 * colo["mlp_ms_per_step"] / layers, 1),
        "attention_post_us_per_layer": round(exchange.get("post_us_per_layer", 0.0), 1),
        "ffn_compute_us_per_layer": round(1e3 * ffn_compute / layers, 1),
        "ffn_post_us_per_layer": round(1e3 * ffn_send / layers, 1),
        "hops_us_per_layer": round(
            exchange.get("wait_us_per_layer", 0.0) - 1e3 * (ffn_compute + ffn_send) / layers, 1
        ),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
