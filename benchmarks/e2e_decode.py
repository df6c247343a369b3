"""Time per output token (TPOT) of greedy decode: AFD 1 attention : 1 FFN vs colocated vLLM.

Same tiny DeepSeek-V2 weights, same dtype and threads, in one run. Colocated runs first (one
vLLM process), then afd-ctl + the FFN server + the attention side (two vLLM processes).

How TPOT is measured (benchmarks/decode_runner.py, benchmarks/timing_stats.py): per request,
(last-token time - first-token time) / (tokens - 1) from vLLM's own engine-core timestamps
(RequestOutput.metrics, vLLM 0.26 and 0.32), so the prefill and the start and end of
generate() are outside it; the median over the batch is one repeat's TPOT. Every batch size
runs once untimed before any timing; then --repeats timed repeats. The figures are medians over
repeats with their min and max; a ratio is taken from medians and comes with its range.

What refuses a run (exit status 3, the reason on stderr and in {"refused": ...}; no figure of
it is written anywhere): a zero, negative or non-finite time; a request with fewer tokens than
asked, or preempted; a decode span longer than generate() took; decode tokens/s that disagrees
with batch / TPOT by more than 10% (the requests did not decode together); a spread
(max - min) / median over repeats wider than --spread-bound (default 0.15 on GPU, 0.35 for
AFD's parts with --one-gpu, where two engines share the GPU, 0.5 on the shared CPU machine); Triton kernels compiled, vLLM compiles (in-process engine) or FFN graphs
captured late during a timed generate(). In GPU mode, across runs of one part (several calls,
or --rounds) the run medians must also stay within the bound, and MPS must be on in all of the
compared parts or in none.

Where the added time goes, per decode step (CPU):
- `*_mlp_ms_per_step`: time inside the decoder layers' MLP/MoE modules on the attention side
  (median over steps); colocated that is the FFN compute, under AFD it is the proxies' round
  trip to the FFN server.
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

`afd_ep2` is (b) with two expert-parallel FFN servers (1 attention : 2 FFN, each holding half
the routed experts, the shared expert and dense layer on the first): its rows carry
`ratio_tpot_afd_ep2_vs_afd`, and the JSON each rank's `ffn_weight_bytes_per_rank` (and, from the
FFN servers' start-up lines, `ffn_cuda_allocated_bytes_per_rank`) beside 1:1's
(`ffn_weight_bytes_per_rank_afd`).
`afd_dbo` is (b) with dual-batch overlap (`--enable-dbo`, vLLM's decode threshold of 32 rows:
smaller batches run as one micro-batch). `--one-gpu` puts AFD's two servers on cuda:0 (a
check of the path where only one GPU is lent; its figures are not the comparison).
`--part colocated_1gpu,afd --rounds 2` runs the parts interleaved (A, B, A, B) in one call, so
drift on a shared GPU does not favour one side; with `--one-gpu` and several parts that is the
default, and a further round (up to --max-rounds, within --budget-s) runs while a part's run
medians spread wider than the bound. `--cudagraph-mode MODE` sets vLLM's
compilation_config.cudagraph_mode for the attention/colocated engine (e.g. FULL_DECODE_ONLY).

Each run adds its figures to S.json (a part takes a few minutes, so each fits one call on a
machine with a per-command limit); the JSON line compares what is there. GPU-mode rows carry
`ratio_tpot_afd_vs_colocated_1gpu` (from medians, with `_range`), `per_layer_added_us`
((TPOT_afd - TPOT_colocated) / layers), and the top level `mps` and the graph modes.

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

from benchmarks import gpu_setup  # noqa: E402
from benchmarks.timing_stats import (  # noqa: E402
    SPREAD_BOUND_CPU,
    SPREAD_BOUND_GPU,
    SPREAD_BOUND_GPU_SHARED,
    BenchmarkRefused,
    Spread,
    added_per_layer_us,
    ratio,
)
from vllm_ext.testing.processes import Daemon, Proc, stop_children_on_sigterm  # noqa: E402
from vllm_ext.testing.procs import ffn_argv, vllm_env  # noqa: E402
from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek  # noqa: E402

STATS_RE = re.compile(r"afd ffn \S+: stats (\{.*\})")
GPU_PARTS = ("colocated_1gpu", "afd", "afd_dbo", "afd_ep2", "colocated_2gpu")
# The FFN server's start-up line with what it holds (vllm_ext.ffn.stack.finalize_ffn_stack).
WEIGHTS_RE = re.compile(r"weights (\d+) bytes \(routed experts (\d+) of (\d+)")
CUDA_RE = re.compile(r"cuda memory allocated (\d+) bytes")
RUNNER = ROOT / "benchmarks" / "decode_runner.py"
REFUSED_EXIT = 3


def spread_bound(args: argparse.Namespace, part: str = "") -> float:
    """--spread-bound, else by where the part runs: the shared CPU machine, AFD's two engines
    sharing one GPU (--one-gpu), an engine on its own GPU(s)."""
    if args.spread_bound:
        return args.spread_bound
    if not args.gpu:
        return SPREAD_BOUND_CPU
    return SPREAD_BOUND_GPU_SHARED if args.one_gpu and part.startswith("afd") else SPREAD_BOUND_GPU


def runner_argv(model: Path, args: argparse.Namespace, part: str, *extra: str) -> list[str]:
    return [
        sys.executable, str(RUNNER), str(model), "--tokens", str(args.tokens),
        "--repeats", str(args.repeats), "--spread-bound", str(spread_bound(args, part)), *extra,
    ]  # fmt: skip


def runner_report(proc: Proc, timeout: float) -> dict[str, Any]:
    """The runner's JSON line; its refusal raised as BenchmarkRefused."""
    report = proc.json_report(timeout=timeout)
    if "refused" in report:
        raise BenchmarkRefused(f"{proc.log_path.stem}: {report['refused']}")
    return report


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


def gpu_part(part: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Runs one part of the GPU comparison once; returns its per-batch figures."""
    batches = [int(b) for b in args.batches.split(",")]
    model = gpu_setup.write_v3_shaped(tmp / "model", args.layers)
    extra = gpu_setup.plugin_path(tmp)
    kwargs = gpu_llm_kwargs(max(batches), args.gpu_memory)
    if args.cudagraph_mode:
        kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    afd_part = part.startswith("afd")
    if part == "colocated_2gpu":
        kwargs.update(tensor_parallel_size=2, enable_expert_parallel=True)
    # Attention (or colocated) on cuda:0, the FFN server on cuda:1; both visible, for CUDA IPC.
    main_gpus, ffn_gpus = ("0", "0") if args.one_gpu else ("0,1", "1,0")
    runner_extra = ["--gpu", "--batches", args.batches]
    with gpu_setup.part_processes() as procs:
        ffn_ranks = 2 if part == "afd_ep2" else 1
        ffn_procs: list[Proc] = []
        if afd_part:
            ffn_memory = gpu_setup.ONE_GPU.ffn_memory if args.one_gpu else args.gpu_memory
            daemon = Daemon(
                tmp / "daemon.log", "--expect-attention", "1", "--expect-ffn", str(ffn_ranks)
            )
            procs.append(daemon)
            ffn_flags = [
                "--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", "1024",
                "--max-num-seqs", str(max(batches)),
                "--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"]),
                "--gpu-memory-utilization", str(ffn_memory),
            ]  # fmt: skip
            for rank in range(ffn_ranks):  # afd_ep2: each FFN server holds half the experts
                argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
                        "--afd-role", "ffn", "--afd-controller", daemon.address, *ffn_flags,
                        "--additional-config", json.dumps({"afd": {"ffn_rank": rank}})]  # fmt: skip
                ffn_procs.append(
                    Proc(argv, tmp / f"ffn{rank}.log", gpu_setup.gpu_env(ffn_gpus, extra))
                )
            procs.extend(ffn_procs)
            # Late captures are counted from rank 0's log (both ranks get the same payloads).
            runner_extra += ["--ffn-log", str(tmp / "ffn0.log")]
            afd: dict[str, Any] = {"role": "attention", "controller": daemon.address}
            if part == "afd_dbo":  # dual-batch overlap from vLLM's decode threshold on
                kwargs["enable_dbo"] = True
            kwargs["additional_config"] = {"afd": afd}
            if args.one_gpu:
                kwargs.update(
                    gpu_memory_utilization=gpu_setup.ONE_GPU.attention_memory,
                    kv_cache_memory_bytes=gpu_setup.ONE_GPU.kv_cache_bytes,
                )
        main_proc = Proc(
            runner_argv(model, args, part, *runner_extra, "--llm-kwargs", json.dumps(kwargs)),
            tmp / f"{part}.log",
            gpu_setup.gpu_env(main_gpus, extra),
        )
        procs.append(main_proc)
        report = runner_report(main_proc, args.timeout)
        report["placement"] = (
            gpu_setup.SHARED_PLACEMENT if args.one_gpu and afd_part else "own GPU(s)"
        )
        report["cudagraph_mode"] = args.cudagraph_mode or "vLLM default"
        if afd_part:
            main_proc.wait(120)  # its exit publishes stop: the FFN server logs its stats
            for ffn in ffn_procs:
                ffn.wait(60)
            match = STATS_RE.search(ffn_procs[0].log())
            report["ffn_stats"] = json.loads(match.group(1)) if match else {}
            report["ffn_ranks"] = ffn_ranks
            report.update(ffn_holdings([f.log() for f in ffn_procs]))
    return report


def ffn_holdings(logs: list[str]) -> dict[str, Any]:
    """What each FFN rank said it holds at start-up: weight bytes, routed experts, and (CUDA)
    the memory allocated once its weights were loaded."""
    found: dict[str, Any] = {}
    weights = [WEIGHTS_RE.search(log) for log in logs]
    if all(weights):
        found["ffn_weight_bytes_per_rank"] = [int(m.group(1)) for m in weights if m]
        found["ffn_routed_experts_per_rank"] = [int(m.group(2)) for m in weights if m]
    cuda = [CUDA_RE.search(log) for log in logs]
    if all(cuda):
        found["ffn_cuda_allocated_bytes_per_rank"] = [int(m.group(1)) for m in cuda if m]
    return found


def pooled(runs: list[dict[str, Any]], batch: str, key: str) -> list[float]:
    """Every repeat's value of `key` at `batch` over the runs (TPOT: the per-repeat list)."""
    values: list[float] = []
    for run in runs:
        figures = run["batches"].get(batch)
        if figures is None:
            continue
        if key == "tpot_ms":
            values += figures["tpot_ms_repeats"]
        else:
            values.append(figures[key]["median"])
    return values


def part_runs(state: dict[str, Any], part: str) -> list[dict[str, Any]]:
    entry = state.get(part, {})
    return entry.get("runs", []) if isinstance(entry, dict) else []


def gpu_summary(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The comparison of the parts in `state`: TPOT and tokens/s per GPU with their spreads,
    ratios from medians with their range. Raises BenchmarkRefused when the parts cannot be
    compared (run medians spread wider than the bound, MPS on in some parts only)."""
    done = [p for p in GPU_PARTS if part_runs(state, p)]
    result: dict[str, Any] = {
        "benchmark": "e2e_decode",
        "mode": "gpu",
        "model": f"deepseek-v3-shaped-{args.layers}-layers-dummy",
        "layers": args.layers,
        "decode_tokens": args.tokens,
        "repeats": args.repeats,
        "spread_bound_by_part": {p: spread_bound(args, p) for p in done},
        "parts_done": done,
        "runs_per_part": {p: len(part_runs(state, p)) for p in done},
    }
    refusals: list[str] = []
    mps = {p: sorted({bool(r.get("mps")) for r in part_runs(state, p)}) for p in done}
    flat = {m for modes in mps.values() for m in modes}
    if len(flat) == 1:
        result["mps"] = flat.pop()
    elif flat:
        result["mps_by_part"] = mps
        refusals.append(f"MPS was on in some runs and off in others: {mps}")
    result["cudagraph_mode_by_part"] = {
        p: sorted({r.get("cudagraph_mode", "vLLM default") for r in part_runs(state, p)})
        for p in done
    }
    gpus = {"colocated_1gpu": 1, "afd": 2, "afd_dbo": 2, "afd_ep2": 3, "colocated_2gpu": 2}
    shared = [
        p for p in ("afd", "afd_dbo", "afd_ep2")
        if any(r.get("placement") == gpu_setup.SHARED_PLACEMENT for r in part_runs(state, p))
    ]  # fmt: skip
    if shared:  # both AFD servers on one GPU: tokens/s per GPU counts the one
        gpus.update(dict.fromkeys(shared, 1))
        result["afd_on_one_gpu"] = shared
    for batch in args.batches.split(","):
        row: dict[str, Any] = {}
        tpot: dict[str, Spread] = {}
        for part in done:
            runs = part_runs(state, part)
            values = pooled(runs, batch, "tpot_ms")
            if not values:
                continue
            tpot[part] = Spread.of(values)
            row[f"tpot_ms_{part}"] = round(tpot[part].median, 3)
            row[f"tpot_ms_{part}_spread"] = tpot[part].as_dict()
            medians = [r["batches"][batch]["tpot_ms"]["median"] for r in runs
                       if batch in r["batches"]]  # fmt: skip
            if len(medians) > 1:
                across = Spread.of(medians)
                row[f"tpot_ms_{part}_run_medians"] = [round(m, 3) for m in medians]
                if across.relative > spread_bound(args, part):
                    refusals.append(
                        f"batch {batch}, {part}: run medians {medians} spread "
                        f"{across.relative:.2f}, wider than the bound {spread_bound(args, part)}"
                    )
            rates = Spread.of(pooled(runs, batch, "decode_tokens_per_s"))
            row[f"tokens_per_s_per_gpu_{part}"] = round(rates.median / gpus[part], 1)
            last = runs[-1]["batches"].get(batch, {})
            if part.startswith("afd") and "exchange_post_ms_per_step" in last:
                exchange = last["exchange_post_ms_per_step"] + last["exchange_wait_ms_per_step"]
                row[f"{part}_exchange_ms_per_step"] = round(exchange, 3)
                row[f"{part}_exchange_share_of_step"] = round(exchange / tpot[part].median, 3)
        base = tpot.get("colocated_1gpu")
        for part in ("afd", "afd_dbo"):
            if part in tpot and base is not None:
                r = ratio(tpot[part], base)
                row[f"ratio_tpot_{part}_vs_colocated_1gpu"] = round(r.value, 3)
                row[f"ratio_tpot_{part}_vs_colocated_1gpu_range"] = [
                    round(r.low, 3), round(r.high, 3)
                ]  # fmt: skip
        if "afd" in tpot and base is not None:
            added = added_per_layer_us(tpot["afd"], base, args.layers)
            row["per_layer_added_us"] = round(added.value, 1)
            row["per_layer_added_us_range"] = [round(added.low, 1), round(added.high, 1)]
        if "afd_ep2" in tpot and "afd" in tpot:  # 1 attention : 2 expert-parallel FFN vs 1:1
            r = ratio(tpot["afd_ep2"], tpot["afd"])
            row["ratio_tpot_afd_ep2_vs_afd"] = round(r.value, 3)
            row["ratio_tpot_afd_ep2_vs_afd_range"] = [round(r.low, 3), round(r.high, 3)]
        if "afd_dbo" in tpot and "afd" in tpot:
            r = ratio(tpot["afd_dbo"], tpot["afd"])
            row["ratio_tpot_afd_dbo_vs_afd"] = round(r.value, 3)
            row["ratio_tpot_afd_dbo_vs_afd_range"] = [round(r.low, 3), round(r.high, 3)]
        dbo_ids, afd_ids = (
            (part_runs(state, p) or [{}])[-1].get("batches", {}).get(batch, {}).get("token_ids")
            for p in ("afd_dbo", "afd")
        )
        if dbo_ids is not None and afd_ids is not None:  # same dummy weights in both runs
            row["identical_tokens_afd_dbo_vs_afd"] = dbo_ids == afd_ids
        if "tokens_per_s_per_gpu_afd" in row and "tokens_per_s_per_gpu_colocated_2gpu" in row:
            row["ratio_tokens_per_gpu_afd_vs_colocated_2gpu"] = round(
                row["tokens_per_s_per_gpu_afd"] / row["tokens_per_s_per_gpu_colocated_2gpu"], 3
            )
        result[f"batch_{batch}"] = row
    same = [r["identical_tokens_afd_dbo_vs_afd"] for k, r in result.items()
            if k.startswith("batch_") and "identical_tokens_afd_dbo_vs_afd" in r]  # fmt: skip
    if same:
        result["identical_tokens"] = all(same)
    afd_runs = part_runs(state, "afd")
    ffn = afd_runs[-1].get("ffn_stats", {}) if afd_runs else {}
    if ffn:
        result["ffn_compute_ms_median_all_steps"] = ffn.get("compute_ms_median")
    for part in ("afd", "afd_ep2"):  # what each FFN rank holds (the last run's start-up)
        last = (part_runs(state, part) or [{}])[-1]
        for key in ("ffn_ranks", "ffn_weight_bytes_per_rank", "ffn_routed_experts_per_rank",
                    "ffn_cuda_allocated_bytes_per_rank"):  # fmt: skip
            if key in last:
                result[f"{key}_{part}" if part == "afd" else key] = last[key]
    if state.get("refusals"):
        result["runs_refused"] = state["refusals"]
    result["note"] = (
        "TPOT per request from vLLM's first/last-token timestamps, medians over repeats "
        "(and runs) with min/max; dummy weights: the FFN server's differ from the colocated "
        "ones (vLLM's dummy loader draws per module), so tokens are not compared; exchange = "
        "the attention side's own timers (post + wait until the output is back), so it "
        "includes the FFN compute"
    )
    if refusals:
        raise BenchmarkRefused("; ".join(refusals))
    return result


def wide_parts(state: dict[str, Any], parts: list[str], args: argparse.Namespace) -> list[str]:
    """Parts whose run medians (or, with one run, repeats) spread wider than half the bound at
    some batch: another interleaved round helps there."""
    wide = []
    for part in parts:
        runs = part_runs(state, part)
        for batch in runs[-1]["batches"] if runs else {}:
            medians = [r["batches"][batch]["tpot_ms"]["median"] for r in runs
                       if batch in r["batches"]]  # fmt: skip
            values = medians if len(medians) > 1 else pooled(runs, batch, "tpot_ms")
            if Spread.of(values).relative > spread_bound(args, part) / 2:
                wide.append(part)
                break
    return wide


def main_gpu(args: argparse.Namespace) -> None:
    state_path = Path(args.state)
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    for part in GPU_PARTS:  # figures of the old (t(N) - t(1)) / (N - 1) TPOT are not mixed in
        if isinstance(state.get(part), dict) and "runs" not in state[part]:
            print(f"dropping {part} from {state_path}: figures of the old TPOT", file=sys.stderr)
            del state[part]
    parts = [p for p in (args.part or "").split(",") if p]
    unknown = sorted(set(parts) - set(GPU_PARTS))
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; known: {', '.join(GPU_PARTS)}")
    if "colocated_2gpu" in parts and args.one_gpu:
        raise SystemExit("colocated_2gpu needs two GPUs; drop --one-gpu")
    rounds = args.rounds or (2 if args.one_gpu and len(parts) > 1 else 1)
    mps = gpu_setup.mps_state(args.mps)
    started = time.monotonic()
    refused: list[str] = []
    failed: list[str] = []
    done = 0
    while parts:
        if done >= rounds:  # another round only to interleave parts whose spread is wide
            wide = wide_parts(state, parts, args) if len(parts) > 1 else []
            if not wide or done >= args.max_rounds:
                break
            if (time.monotonic() - started) * (done + 1) / done > args.budget_s:
                print(f"no time left for another round ({wide} spread wide)", file=sys.stderr)
                break
        for part in parts:  # A, B, A, B: drift hits every part alike
            run_started = time.monotonic()
            try:
                with tempfile.TemporaryDirectory(prefix="afd-e2e-gpu-") as tmp:
                    run = gpu_part(part, args, Path(tmp))
            except BenchmarkRefused as exc:  # its reason is kept, none of its figures
                refused.append(str(exc))
                state.setdefault("refusals", []).append(str(exc))
                state_path.write_text(json.dumps(state))
                print(f"refused: {exc}", file=sys.stderr, flush=True)
                continue
            except (AssertionError, RuntimeError, OSError) as exc:  # the next part may still run
                failed.append(f"{part}: {str(exc).splitlines()[0] if str(exc) else type(exc)}")
                print(f"failed: {part}: {exc}", file=sys.stderr, flush=True)
                continue
            run.update(mps)
            run["wall_s"] = round(time.monotonic() - run_started, 1)
            state.setdefault(part, {"runs": []})["runs"].append(run)
            state_path.write_text(json.dumps(state))
        done += 1
    try:
        summary = gpu_summary(state, args)
    except BenchmarkRefused as exc:
        refused.append(str(exc))
        summary = {"benchmark": "e2e_decode", "mode": "gpu"}
    if refused:
        print(json.dumps({**summary_head(summary), "refused": refused, "failed": failed}),
              flush=True)  # fmt: skip
        sys.exit(REFUSED_EXIT)
    if failed:
        summary["failed"] = failed
    print(json.dumps(summary), flush=True)
    if failed:
        sys.exit(1)


def summary_head(summary: dict[str, Any]) -> dict[str, Any]:
    """What a refused run's JSON keeps: labels and settings, no figures."""
    keep = ("benchmark", "mode", "model", "layers", "decode_tokens", "repeats", "spread_bound_by_part",
            "parts_done", "runs_per_part", "mps", "cudagraph_mode_by_part")  # fmt: skip
    return {k: summary[k] for k in keep if k in summary}


def cpu_mla_backend() -> tuple[list[str], list[str]]:
    """Runner and FFN-server flags naming vLLM's reference CPU MLA backend on vLLM 0.32: its CPU
    platform prefers the AMX MLA backend on CPUs with AMX tiles, which packs weights only in
    16-bit types and fails on the float32 tiny model. vLLM 0.26 runs DeepSeek on CPU without
    MLA (offline.CPU_ENV), so it needs nothing."""
    from vllm_ext.testing.offline import _installed_vllm_line

    if _installed_vllm_line() == "0.26":
        return [], []
    return (
        ["--llm-kwargs", json.dumps({"attention_backend": "CPU_MLA"})],
        ["--attention-backend", "CPU_MLA"],
    )


def cpu_run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="afd-e2e-") as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = build_tiny_deepseek(out / "model", version=args.version)
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        runner_mla, ffn_mla = cpu_mla_backend()
        bench = ["--batches", str(args.batch), "--mlp-timers", *runner_mla]
        env = vllm_env(in_process=True)
        colocated = Proc(runner_argv(model, args, "colocated", *bench), out / "colocated.log", env)
        try:
            colo = runner_report(colocated, timeout=600)
        finally:
            colocated.stop()

        daemon = Daemon(out / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
        ffn = Proc(ffn_argv(model, daemon.address, *ffn_mla), out / "ffn.log", vllm_env())
        attention = Proc(
            runner_argv(
                model,
                args,
                "afd",
                *bench,
                "--afd-controller",
                daemon.address,
                "--ffn-log",
                str(out / "ffn.log"),
            ),  # fmt: skip
            out / "attention.log",
            env,
        )
        try:
            afd = runner_report(attention, timeout=600)
            attention.wait(120)  # its exit publishes stop: the FFN server logs its stats
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

    b = str(args.batch)
    afd_row, colo_row = afd["batches"][b], colo["batches"][b]
    afd_tpot, colo_tpot = (Spread.of(r["tpot_ms_repeats"]) for r in (afd_row, colo_row))
    r = ratio(afd_tpot, colo_tpot)
    # The attention side's exchange per layer over decode steps only (the runner's N-token run
    # less a 1-token run), not its whole-run counters, which count warm-up and prefills too.
    per_layer = 1e3 / max(1e-9, float(afd_row.get("exchanges_per_step", 0.0)))
    post_us = per_layer * float(afd_row.get("exchange_post_ms_per_step", 0.0))
    wait_us = per_layer * float(afd_row.get("exchange_wait_ms_per_step", 0.0))
    ffn_send = float(ffn_stats.get("send_ms_median", 0.0))
    # Medians over the FFN server's last 1000 steps: a typical decode step (the means also
    # count the memory-profiling run and the prefills).
    ffn_compute = float(ffn_stats.get("compute_ms_median", 0.0))
    return {
        "benchmark": "e2e_decode",
        "model": f"tiny-deepseek-v{args.version}",
        "decode_tokens": args.tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "spread_bound": spread_bound(args),
        "afd_tpot_ms": round(afd_tpot.median, 3),
        "colocated_tpot_ms": round(colo_tpot.median, 3),
        "ratio_tpot_afd_vs_colocated": round(r.value, 3),
        "ratio_tpot_afd_vs_colocated_range": [round(r.low, 3), round(r.high, 3)],
        "afd_tpot_ms_spread": afd_tpot.as_dict(),
        "colocated_tpot_ms_spread": colo_tpot.as_dict(),
        "identical_tokens": afd_row["token_ids"] == colo_row["token_ids"],
        "colocated_mlp_ms_per_step": round(colo_row["mlp_ms_per_step"], 3),
        "afd_mlp_roundtrip_ms_per_step": round(afd_row["mlp_ms_per_step"], 3),
        "ffn_compute_ms_per_step": round(ffn_compute, 3),
        "ffn_recv_wait_ms_per_step": round(float(ffn_stats.get("recv_wait_ms_median", 0)), 3),
        "ffn_send_ms_per_step": round(ffn_send, 3),
        "afd_exchange_overhead_ms_per_step": round(afd_row["mlp_ms_per_step"] - ffn_compute, 3),
        "ffn_steps_served": ffn_stats.get("steps"),
        "colocated_mlp_us_per_layer": round(1e3 * colo_row["mlp_ms_per_step"] / layers, 1),
        "attention_post_us_per_layer": round(post_us, 1),
        "ffn_compute_us_per_layer": round(1e3 * ffn_compute / layers, 1),
        "ffn_post_us_per_layer": round(1e3 * ffn_send / layers, 1),
        "hops_us_per_layer": round(wait_us - 1e3 * (ffn_compute + ffn_send) / layers, 1),
        "late_events_checked": afd.get("late_events_checked", []),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    stop_children_on_sigterm()  # `timeout` must not leave servers holding the GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 tokens, 3 repeats (< 5 min)")
    parser.add_argument("--tokens", type=int, default=0, help="default 128, GPU 256, quick 32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--version", type=int, default=2, choices=(2, 3))
    parser.add_argument("--keep", default="", help="CPU: keep the model and logs in this folder")
    parser.add_argument(
        "--spread-bound", type=float, default=0.0,
        help=f"widest (max - min) / median over repeats (default {SPREAD_BOUND_GPU} on GPU, "
        f"{SPREAD_BOUND_GPU_SHARED} with --one-gpu, {SPREAD_BOUND_CPU} on CPU)",
    )  # fmt: skip
    gpu = parser.add_argument_group("GPU mode")
    gpu.add_argument("--gpu", action="store_true", help="DeepSeek-V3-shaped, two GPUs")
    gpu.add_argument(
        "--part", default="",
        help="comma-separated parts to run, interleaved per round (else: summarise state); "
        "with --interleave: two or more of colocated, afd, afd_relay, afd_unbatched, afd_dbo, "
        "afd_base, afd_poll, afd_memset, afd_resets (default colocated,afd)",
    )  # fmt: skip
    gpu.add_argument("--state", default="e2e_gpu_state.json", help="runs' figures accumulate here")
    gpu.add_argument("--batches", default="16,64,256")
    gpu.add_argument("--layers", type=int, default=4)
    gpu.add_argument("--gpu-memory", type=float, default=0.85)
    gpu.add_argument("--timeout", type=float, default=540.0, help="seconds for one part")
    gpu.add_argument("--rounds", type=int, default=0,
                     help="rounds of the parts (default: 2 with --one-gpu and several parts)")  # fmt: skip
    gpu.add_argument("--max-rounds", type=int, default=3, help="extra rounds while spread is wide")
    gpu.add_argument("--budget-s", type=float, default=540.0, help="no new round past this")
    gpu.add_argument("--cudagraph-mode", default="",
                     help="vLLM compilation_config.cudagraph_mode, e.g. FULL_DECODE_ONLY")  # fmt: skip
    gpu.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                     help="record MPS as detected (auto) or as stated")  # fmt: skip
    gpu.add_argument(
        "--one-gpu", action="store_true",
        help="AFD's two servers share cuda:0 (a check of the path on a one-GPU machine, not a "
        "deployment: its figures are not the two-GPU comparison)",
    )  # fmt: skip
    il = parser.add_argument_group(
        "interleaved (both engines up at once; benchmarks/e2e_interleaved.py)"
    )
    il.add_argument(
        "--interleave",
        action="store_true",
        help="colocated and AFD up at once, their repeats alternating per batch",
    )
    il.add_argument("--depths", default="", help="model layers per run (GPU default 2,4; CPU 4)")
    il.add_argument(
        "--interval-bound",
        type=float,
        default=0.25,
        help="refuse a ratio whose 95%% interval is wider than this share of it",
    )
    il.add_argument(
        "--max-repeats", type=int, default=0,
        help="more repeats (up to this many in all) of a batch size whose ratio interval is "
        "wider than --interval-bound, before refusing it (default: --repeats only)",
    )  # fmt: skip
    il.add_argument("--more-budget-s", type=float, default=240.0,
                    help="no further round of --max-repeats past this many seconds")  # fmt: skip
    il.add_argument("--prompt-tokens", type=int, default=128, help="GPU: each prompt's length")
    il.add_argument(
        "--colocated-memory",
        type=float,
        default=0.45,
        help="GPU: --gpu-memory-utilization of the colocated engine",
    )
    il.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="GPU: each engine's KV cache (default: what the largest batch's requests hold at "
        "once, plus a margin, at least 1 GiB)",
    )
    il.add_argument(
        "--experts",
        type=int,
        default=256,
        help="GPU: routed experts per MoE layer of the V3-shaped model (fewer: deeper models "
        "fit two engines on one GPU, e.g. 128 for a 2/3/4-layer fit, 16 for 8/16 layers)",
    )
    il.add_argument("--log-dir", default="", help="keep every process's log of each run here")
    il.add_argument(
        "--base-tree", default="",
        help="another checkout of this project (e.g. `git archive` of the commit before a "
        "change): --part afd_base is an AFD pair run from it, so one call measures before "
        "against after",
    )  # fmt: skip
    il.add_argument(
        "--host-profile-batch", default="",
        help="after the timed repeats, one more repeat at this batch (or each of B,B,...) per "
        "part under py-spy "
        "(benchmarks/host_profile.py; raw stacks kept under --log-dir)",
    )  # fmt: skip
    il.add_argument(
        "--py-spy", default="py-spy", help="the py-spy binary --host-profile-batch uses"
    )
    il.add_argument("--py-spy-rate", type=int, default=250, help="py-spy samples per second")
    il.add_argument("--py-spy-idle", action="store_true",
                    help="waiting threads too: where the engine's thread waits")  # fmt: skip
    il.add_argument("--py-spy-native", action="store_true",
                    help="native frames too (py-spy pauses the process per sample)")  # fmt: skip
    il.add_argument("--start-timeout", type=float, default=420.0)
    il.add_argument("--run-timeout", type=float, default=120.0, help="seconds for one repeat")
    il.add_argument(
        "--one-depth-per-call",
        action="store_true",
        help="run at most one depth missing from --state, then summarise",
    )
    il.add_argument(
        "--calls-per-depth", type=int, default=1,
        help="run each depth this many times, each with its own engine starts (with "
        "--one-depth-per-call: one per call, 4, 6, 6, 4 ...); ratios and fit are means over "
        "the calls, their intervals resampling the calls too",
    )  # fmt: skip
    args = parser.parse_args()
    if args.interleave:
        from benchmarks import e2e_interleaved

        if args.quick:
            args.tokens, args.repeats = args.tokens or 32, 3
        args.tokens = args.tokens or (256 if args.gpu else 64)
        args.depths = args.depths or ("2,4" if args.gpu else "4")
        if not args.gpu:
            args.batches = str(args.batch)
        sys.exit(e2e_interleaved.main(args))
    if args.gpu:
        args.tokens = args.tokens or 256
        main_gpu(args)
        return
    if args.quick:
        args.tokens, args.repeats = args.tokens or 32, 3
    args.tokens = args.tokens or 128
    try:
        result = cpu_run(args)
    except BenchmarkRefused as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({"benchmark": "e2e_decode", "refused": [str(exc)]}), flush=True)
        sys.exit(REFUSED_EXIT)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
