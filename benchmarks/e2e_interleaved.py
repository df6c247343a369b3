"""TPOT of AFD against colocated vLLM with both engines up at once, interleaved per batch size,
with intervals instead of spread refusals; the mode `e2e_decode.py --interleave` runs.

Per depth (`--depths`, model layers; the DeepSeek-V3-shaped model on GPU, the tiny DeepSeek on
CPU): the colocated engine and the AFD pair (afd-ctl, an FFN server, the attention engine)
start together; once both are warm every batch size's timed repeats alternate between them (A,
B at one repeat, B, A at the next: benchmarks/interleave.py), so drift on a shared machine hits
both alike. What is reported per depth and batch: both medians, the ratio AFD / colocated
with its 95% bootstrap interval, and with two depths or more the fit of what AFD adds per step and
per layer, each with its interval, over depths of one pacing (depth_fit: on one H200, 2 layers'
steps wait for vLLM's host and 4 layers' for the GPU; fit 4 and 6 there). A ratio interval
wider than `--interval-bound` (relative) first gets more repeats of its batch size alone
(`--max-repeats`, within `--more-budget-s`: noise measured longer where it is, not everywhere),
then refuses the run, naming it;
everything else decode_runner refuses stays refused. With `--calls-per-depth K` each depth is run
K times, each its own engine starts (with `--one-depth-per-call`, one call of the run each, in
the order 4, 6, 6, 4 ...): ratios and the fit are then the means over calls, each interval the
wider of a t interval over the calls and a bootstrap of calls and repeats, so it holds where a
start lands (a call's own interval does not: 2026-12-07, one H100, two 4-layer calls 1.013 and
1.023, each interval 0.003 wide).

`--part` picks the parts (default `colocated,afd`): `afd_dbo` is an AFD pair whose attention
engine runs dual-batch overlap (`--enable-dbo`, vLLM's decode threshold), GPU only (vLLM's
micro-batching needs CUDA); `afd_relay` is the AFD pair with `AFD_DIRECT_PAYLOADS=0` (each step
payload reaches the FFN server through afd-ctl's relay only, as before afd_ctl.direct), so
`--part afd_relay,afd` measures the direct path in one call; `afd_unbatched` is the AFD pair
with `AFD_PUBLISH_COALESCE_S=0` (the sender's copies to afd-ctl one message per step), so
`--part afd_unbatched,afd` measures the coalescing window in one call; `afd_base` is the AFD
pair run from another checkout (`--base-tree DIR`: its afd-ctl, plugin and runner), so
`--part colocated,afd_base,afd` measures a change before and after in one call; `afd_poll` is
the AFD pair whose FFN host polls for the next direct payload for 50 ms after each step instead
of sleeping (`AFD_FFN_POLL_S=0.05`); `afd_memset` is the AFD pair whose GPU path raises its
flags with `cuMemsetD32Async` (`AFD_DATA_GPU_FLAG_WRITES=memset`), GPU only, so `--part
colocated,afd,afd_memset` measures that candidate in one call; `afd_resets` is the AFD pair
whose GPU path writes every flag back after its wait (`AFD_DATA_GPU_FLAG_RESETS=each`, the
protocol before flags met by bit), GPU only, so `--part afd_resets,afd` measures that change in
one call. Every later part is compared with every earlier one
(`ratio_tpot_afd_dbo_vs_afd`, `ratio_tpot_afd_dbo_vs_colocated`, ...). One H200 holds two
V3-shaped engines of 3 layers, not three: there, `colocated,afd_dbo` and `afd,afd_dbo` are two
calls.

On GPU the MoE layers route with vLLM's uniform random routing simulation on both sides
(VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random), so each MoE layer reads as many experts
per step as balanced traffic would, not the few a dummy model's collapsed tokens pick; the JSON
says how many (expected distinct experts per MoE layer per step). Each request has a prompt of
its own, all of one length. The AFD parts write their step timelines (AFD_TIMELINE_DIR) and
the JSON carries benchmarks/timeline.py's summary per depth. With `--host-profile-batch B`
each part then runs one untimed repeat at B under py-spy (benchmarks/host_profile.py): where
each busy thread's host time went, per part, beside the TPOT it explains.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import gpu_setup, host_profile, timeline
from benchmarks.interleave import (
    Lockstep,
    More,
    calls_layer_fit,
    calls_ratio_interval,
    expected_distinct_experts,
    interleave,
)
from benchmarks.timing_stats import BenchmarkRefused
from vllm_ext.testing.processes import Daemon, Proc

ROUTING = {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"}


def _runner(
    args: argparse.Namespace, model: Path, kwargs: dict[str, Any], *extra: str
) -> list[str]:
    from benchmarks.e2e_decode import RUNNER

    return [
        sys.executable, str(RUNNER), str(model), "--tokens", str(args.tokens),
        "--repeats", str(args.repeats), "--spread-bound", "1", "--batches", args.batches,
        "--lockstep", "--llm-kwargs", json.dumps(kwargs), *extra,
    ]  # fmt: skip


INTERLEAVED_PARTS = (
    "colocated", "afd", "afd_relay", "afd_unbatched", "afd_dbo", "afd_base", "afd_poll",
    "afd_memset", "afd_resets",
)  # fmt: skip
AFD_PARTS = INTERLEAVED_PARTS[1:]
# The afd_relay part: step payloads through afd-ctl's relay only (no direct copy on the host).
RELAY_ONLY = {"AFD_DIRECT_PAYLOADS": "off"}
# The afd_unbatched part: the sender's copies to afd-ctl never wait for the next payload (one
# gRPC message per step, as before the coalescing window).
# The afd_poll part: the FFN host looks for the next direct payload without sleeping for 50 ms
# after each step (afd ffn_poll_s), so the sender's datagram wakes nobody.
PART_ENV = {
    "afd_relay": RELAY_ONLY,
    "afd_unbatched": {"AFD_PUBLISH_COALESCE_S": "0"},
    "afd_poll": {"AFD_FFN_POLL_S": "0.05"},
    # The afd_memset part: the GPU path's flags by cuMemsetD32Async (afd_data.gpu_protocol).
    "afd_memset": {"AFD_DATA_GPU_FLAG_WRITES": "memset"},
    # The afd_resets part: every flag written back after its wait (gpu_protocol.flag_use).
    "afd_resets": {"AFD_DATA_GPU_FLAG_RESETS": "each"},
}


def parts_of(args: argparse.Namespace) -> list[str]:
    """The parts to interleave, checked (at least two, known, GPU-only ones on GPU)."""
    parts = [p for p in (args.part or "colocated,afd").split(",") if p]
    unknown = [p for p in parts if p not in INTERLEAVED_PARTS]
    if unknown or len(set(parts)) != len(parts) or len(parts) < 2:
        raise SystemExit(
            f"--part {args.part!r}: give two or more of {', '.join(INTERLEAVED_PARTS)}, each once"
        )
    if "afd_dbo" in parts and not args.gpu:
        raise SystemExit("--part afd_dbo needs --gpu: vLLM's micro-batching runs on CUDA only")
    for part in ("afd_memset", "afd_resets"):
        if part in parts and not args.gpu:
            raise SystemExit(f"--part {part} needs --gpu: it changes the GPU path's flags")
    if "afd_base" in parts:
        base_tree(args)
    return parts


def base_tree(args: argparse.Namespace) -> Path:
    """The checkout --part afd_base runs from, checked."""
    tree = Path(args.base_tree or ".").resolve()
    if not args.base_tree or not (tree / "benchmarks" / "decode_runner.py").is_file():
        raise SystemExit(
            f"--part afd_base needs --base-tree DIR, a checkout of this project ({tree} has no "
            "benchmarks/decode_runner.py); e.g. mkdir DIR && git archive BASE | tar -x -C DIR"
        )
    return tree


def from_tree(tree: Path, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """`argv` and `env` run from the checkout `tree`: its runner script, its packages first on
    the path (the processes start in it, so `python -m` finds its packages first too)."""
    from benchmarks.e2e_decode import RUNNER

    argv = [str(tree / RUNNER.relative_to(RUNNER.parents[1])) if a == str(RUNNER) else a
            for a in argv]  # fmt: skip
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return argv, {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), path) if p)}


def model_len(args: argparse.Namespace) -> int:
    """GPU: every engine's max_model_len, 1024 or what a prompt and its decode need (long
    prompts make attention the larger part of a step: where dual-batch overlap can pay)."""
    return max(1024, args.prompt_tokens + args.tokens + 16)


def more_of(args: argparse.Namespace) -> More | None:
    """--max-repeats past --repeats: more repeats of a batch size whose interval is too wide."""
    if getattr(args, "max_repeats", 0) <= args.repeats:
        return None
    return More(args.interval_bound, args.max_repeats, args.more_budget_s)


KV_BLOCK = 16  # vLLM's KV cache block, in tokens (64 under FlashMLA: KV_MARGIN covers the rest)
KV_MARGIN = 256 << 20  # past what the largest batch holds: a block a request and rounding


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def kv_cache_bytes(args: argparse.Namespace, depth: int, batch: int) -> int:
    """Each engine's KV cache (--kv-cache-bytes, else sized to the run): the largest batch's
    requests hold their prompt and decode tokens at once, in whole blocks. Without the flag,
    what they need plus a margin, at least 1 GiB (a fixed 8 GiB put the 4-layer
    `--experts 64` pair over an 80 GB card's memory); with it, refused below what they need
    (they would not decode together)."""
    per_request = round_up(args.prompt_tokens + args.tokens + 1, KV_BLOCK)
    need = batch * per_request * gpu_setup.v3_kv_bytes_per_token(depth)
    if args.kv_cache_bytes is None:
        return max(1 << 30, round_up(need + KV_MARGIN, KV_MARGIN))
    if args.kv_cache_bytes < need:
        raise BenchmarkRefused(
            f"--kv-cache-bytes {args.kv_cache_bytes}: batch {batch} of {per_request}-token "
            f"requests at {depth} layers needs {need} bytes of KV cache; give at least that, "
            "or leave the flag out to size it to the run"
        )
    return int(args.kv_cache_bytes)


def depth_run(args: argparse.Namespace, depth: int, tmp: Path) -> dict[str, Any]:
    """Every part at one depth, interleaved: their TPOT repeats per batch and reports."""
    from benchmarks.e2e_decode import build_tiny_deepseek, cpu_mla_backend, gpu_llm_kwargs
    from vllm_ext.testing.procs import ffn_argv, vllm_env

    batches = [int(b) for b in args.batches.split(",")]
    timeline_dir = tmp / "timeline"
    procs: list[Proc] = []
    ffn_procs: dict[str, Proc] = {}  # each AFD part's FFN server (host profiles)
    try:
        if args.gpu:
            model = gpu_setup.write_v3_shaped(tmp / "model", depth, args.experts, model_len(args))
            extra_path = gpu_setup.plugin_path(tmp)
            base = gpu_llm_kwargs(max(batches), 0.0)
            base["max_model_len"] = model_len(args)
            if args.cudagraph_mode:
                base["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
            kv_bytes = kv_cache_bytes(args, depth, max(batches))
            colo_kwargs = dict(base, gpu_memory_utilization=args.colocated_memory,
                               kv_cache_memory_bytes=kv_bytes)  # fmt: skip
            attn_kwargs = dict(base, gpu_memory_utilization=gpu_setup.ONE_GPU.attention_memory,
                               kv_cache_memory_bytes=kv_bytes)  # fmt: skip
            env = {**gpu_setup.gpu_env("0", extra_path), **ROUTING, "PYTHONUNBUFFERED": "1"}
            runner_extra = ["--gpu", "--prompt-tokens", str(args.prompt_tokens)]
            ffn_flags = [
                "--dtype", "bfloat16", "--load-format", "dummy",
                "--max-model-len", str(base["max_model_len"]),
                "--max-num-seqs", str(max(batches)),
                "--max-num-batched-tokens", str(base["max_num_batched_tokens"]),
                "--gpu-memory-utilization", str(gpu_setup.ONE_GPU.ffn_memory),
            ]  # fmt: skip
        else:
            model = build_tiny_deepseek(tmp / "model", version=2)
            layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
            if depth != layers:
                raise BenchmarkRefused(f"on CPU the tiny model has {layers} layers, not {depth}")
            runner_mla, ffn_mla = cpu_mla_backend()
            colo_kwargs = attn_kwargs = json.loads(runner_mla[1]) if runner_mla else {}
            env = vllm_env(in_process=True)
            runner_extra = []
            ffn_flags = ffn_mla

        def afd_pair(part: str) -> Proc:
            """afd-ctl, an FFN server and the attention engine of one AFD part (afd_base: all
            three from --base-tree)."""
            tree = base_tree(args) if part == "afd_base" else None

            def start(argv: list[str], log: Path, env: dict[str, str], **kw: Any) -> Proc:
                if tree is not None:
                    argv, env = from_tree(tree, argv, env)
                return Proc(argv, log, env, cwd=tree, **kw)

            daemon_env = from_tree(tree, [], {})[1] if tree is not None else None
            daemon = Daemon(tmp / f"daemon-{part}-{depth}.log",
                            "--expect-attention", "1", "--expect-ffn", "1",
                            env=daemon_env, cwd=tree)  # fmt: skip
            procs.append(daemon)
            part_timeline = str(timeline_dir / part)
            timeline_env = {"AFD_TIMELINE_DIR": part_timeline, "AFD_TIMELINE_EVERY": "8"}
            part_env = {**env, **timeline_env}
            part_env.update(PART_ENV.get(part, {}))
            ffn_log = tmp / f"ffn-{part}-{depth}.log"
            if args.gpu:
                argv = [
                    sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
                    "--afd-role", "ffn", "--afd-controller", daemon.address, *ffn_flags,
                ]  # fmt: skip
                ffn_procs[part] = start(argv, ffn_log, part_env)
            else:
                ffn_env = {**vllm_env(), **timeline_env}
                ffn_env.update(PART_ENV.get(part, {}))
                ffn_procs[part] = start(
                    ffn_argv(model, daemon.address, *ffn_flags), ffn_log, ffn_env
                )
            procs.append(ffn_procs[part])
            kwargs = dict(attn_kwargs)
            if part == "afd_dbo":  # dual-batch overlap from vLLM's decode threshold on
                kwargs["enable_dbo"] = True
            attention = start(
                _runner(args, model, kwargs, *runner_extra, "--afd-controller", daemon.address,
                        "--ffn-log", str(ffn_log), "--ffn-pid", str(ffn_procs[part].pid)),
                tmp / f"{part}-{depth}.log", part_env, stdin_pipe=True,
            )  # fmt: skip
            procs.append(attention)
            return attention

        lockstep = []
        for part in parts_of(args):
            if part == "colocated":
                proc = Proc(_runner(args, model, colo_kwargs, *runner_extra),
                            tmp / f"colocated-{depth}.log", env, stdin_pipe=True)  # fmt: skip
                procs.append(proc)
            else:
                proc = afd_pair(part)
            lockstep.append(Lockstep(part, proc))
        for part in lockstep:
            part.ready(args.start_timeout)
        tpot = interleave(lockstep, batches, args.repeats, args.run_timeout, more_of(args))
        profiles = {
            f"{part.name}_host_profile{'' if i == 0 else f'_batch_{b}'}": profile_repeat(
                args, part, ffn_procs.get(part.name), depth, tmp, b
            )
            for i, b in enumerate(profile_batches(args))
            for part in lockstep
        }
        reports = {part.name: part.finish(args.run_timeout) for part in lockstep}
        summaries = {
            part.name: timeline.summarise(timeline_dir / part.name)
            for part in lockstep
            if (timeline_dir / part.name).is_dir()
        }
        return {"tpot_ms": tpot, "reports": reports, "timelines": summaries, "profiles": profiles}
    finally:
        for proc in reversed(procs):
            proc.stop()


def profile_batches(args: argparse.Namespace) -> list[int]:
    """--host-profile-batch: the batch sizes to profile (the first one's profiles are reported
    as PART_host_profile, the others' as PART_host_profile_batch_B)."""
    return [int(b) for b in str(args.host_profile_batch or "").split(",") if b.strip()]


def profile_repeat(
    args: argparse.Namespace, part: Lockstep, ffn: Proc | None, depth: int, tmp: Path, batch: int
) -> dict[str, Any]:
    """One untimed repeat of `part` at --host-profile-batch with py-spy on its process tree
    (and its FFN server's): the summaries, raw stacks kept under --log-dir (else dropped)."""
    into = Path(args.log_dir) / "host_profile" if args.log_dir else tmp / "host_profile"
    into.mkdir(parents=True, exist_ok=True)
    targets = {"": part.proc} | ({"ffn": ffn} if ffn is not None else {})
    recordings = {
        side: host_profile.Recording(
            args.py_spy,
            proc.pid,
            into / f"{part.name}-{depth}-{batch}{'-' + side if side else ''}.txt",
            rate=args.py_spy_rate,
            native=args.py_spy_native,
            idle=args.py_spy_idle,
        )
        for side, proc in targets.items()
    }
    started = time.monotonic()
    part.run(batch, args.repeats, args.run_timeout)
    wall_s = time.monotonic() - started
    out: dict[str, Any] = {"batch": batch}
    for side, recording in recordings.items():
        out[side or "engine"] = recording.stop(wall_s)
    return out


def paced_by(runs: list[dict[str, Any]], part: str, batch: int) -> str:
    """ "host" where the part's steps at `batch` waited for the host in every call (its
    timeline's host lead below zero: the GPU idles until vLLM's host hands it the next step),
    "gpu" where the host ran ahead in every call, "" where no timeline says, "mixed" else."""
    paces = set()
    for run in runs:
        rows = run.get("timelines", {}).get(part, {}).get("by_rows", {}).get(str(batch), {})
        lead = rows.get("host_lead_ms")
        paces.add("" if lead is None else ("host" if lead < 0 else "gpu"))
    if len(paces) > 1:
        paces.discard("")  # a call without a timeline row says nothing against the others
    return paces.pop() if len(paces) == 1 else "mixed"


def depth_fit(depths: dict[int, list[dict[str, Any]]], part: str, batch: int) -> dict[str, Any]:
    """What `part` adds per step and per layer at `batch` (layer_fit), over the depths of one
    pacing only: where a shallow depth's steps wait for the host and a deeper one's for the
    GPU, a line through both measures the host's pacing, not AFD (the 12-06 H200 run: 2 layers
    host-paced at a host lead of -0.9 ms, 4 layers GPU-paced at +2.6 ms). GPU-paced depths are
    fitted where two or more are; else host-paced ones; else nothing, saying why. `depths`
    holds each depth's calls."""
    pacing = {d: paced_by(runs, part, batch) for d, runs in depths.items()}
    gpu = [d for d in depths if pacing[d] in ("gpu", "")]
    host = [d for d in depths if pacing[d] == "host"]
    use = gpu if len(gpu) >= 2 else host if len(host) >= 2 else []
    out: dict[str, Any] = {"paced_by": {str(d): pacing[d] or "unknown" for d in sorted(depths)}}
    if not use:
        out["not_fitted"] = (
            f"no two depths of one pacing (GPU-paced {sorted(gpu)}, host-paced {sorted(host)}, "
            f"mixed {sorted(d for d in depths if pacing[d] == 'mixed')}): "
            "add deeper depths, whose steps the GPU paces"
        )
        return out
    if len(use) < len(depths):
        out["left_out_depths"] = sorted(set(depths) - set(use))
    out.update(fitted({d: depths[d] for d in use}, part, batch))
    by_host: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for d in use:
        for run in depths[d]:
            by_host.setdefault(host_of(run), {}).setdefault(d, []).append(run)
    if len(by_host) > 1:
        # Machines of one card kind differ (the fifteenth session: colocated alike, AFD 25 µs a
        # layer apart): each machine's own fit, where it ran two of the depths.
        out["by_host"] = {
            host: {**fitted(mine, part, batch), "calls": sum(map(len, mine.values()))}
            for host, mine in sorted(by_host.items())
            if len(mine) >= 2
        }
    return out


def host_of(run: dict[str, Any]) -> str:
    """The machine a call ran on (its settings' `host`), or "unrecorded" for an older call."""
    return str(run.get("settings", {}).get("host") or "unrecorded")


def fitted(depths: dict[int, list[dict[str, Any]]], part: str, batch: int) -> dict[str, Any]:
    """calls_layer_fit of these calls: what `part` adds per step and per layer, with intervals."""
    step, layer = calls_layer_fit(
        {d: [(r["tpot_ms"][part][batch], r["tpot_ms"]["colocated"][batch]) for r in runs]
         for d, runs in depths.items()}
    )  # fmt: skip
    return {
        "per_step_added_us": round(step.value, 1),
        "per_step_added_us_interval": step.as_list(1),
        "per_layer_added_us": round(layer.value, 1),
        "per_layer_added_us_interval": layer.as_list(1),
    }


def summarise(args: argparse.Namespace, depths: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """The JSON of every depth's calls (`depths`: each depth's runs, one per call). With several
    calls a row's figures are means over the calls that ran its batch with every part; what
    only one call can give (threads, exchange, timeline, profiles) is the last call's
    (`details_from_call`), and the calls' settings are listed where they differ."""
    several = any(len(runs) > 1 for runs in depths.values())
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {
        "benchmark": "e2e_decode",
        "mode": "gpu-interleaved" if args.gpu else "cpu-interleaved",
        "model": "deepseek-v3-shaped-dummy" if args.gpu else "tiny-deepseek-v2",
        "depths": sorted(depths),
        "decode_tokens": args.tokens,
        "repeats": args.repeats,
        # More repeats (up to this many) where an interval stayed wider than the bound.
        "max_repeats": max(args.repeats, getattr(args, "max_repeats", 0)),
        "parts": parts_of(args),
        "interleaved": "A, B then B, A per repeat, every engine up at once",
        "interval": "95% bootstrap of the ratio of medians"
        + (
            "; over several calls, the wider of a t interval over the calls' figures and a "
            "bootstrap of calls and repeats"
            if several
            else ""
        ),
        "interval_bound": args.interval_bound,
    }
    if args.gpu:
        result["routing"] = "vLLM uniform_random routing simulation (both sides)"
        result["routed_experts_per_moe_layer"] = args.experts
        result["distinct_experts_per_moe_layer_per_step"] = {
            str(b): round(expected_distinct_experts(args.experts, 8, b), 1) for b in batches
        }
        result["cudagraph_mode"] = args.cudagraph_mode or "vLLM default"
        result["prompt_tokens"], result["max_model_len"] = args.prompt_tokens, model_len(args)
    refusals = []
    for depth, runs in sorted(depths.items()):
        run = runs[-1]
        parts = list(run["tpot_ms"])
        rows: dict[str, Any] = {}
        if len(runs) > 1:
            rows["details_from_call"] = len(runs)
            differ = settings_that_differ(runs)
            if differ:
                rows["settings_differ"] = differ
        for b in batches:
            calls = [
                {p: r["tpot_ms"][p][b] for p in parts}
                for r in runs
                if all(b in r["tpot_ms"].get(p, {}) for p in parts)
            ]
            if not calls:
                continue
            tpot = calls[-1]
            row: dict[str, Any] = {
                f"tpot_ms_{p}": round(statistics.fmean(statistics.median(c[p]) for c in calls), 3)
                for p in parts
            }
            if len(runs) > 1:
                row["calls"] = len(calls)
            for i, earlier in enumerate(parts):
                for later in parts[i + 1 :]:
                    r = calls_ratio_interval([(c[later], c[earlier]) for c in calls])
                    key = f"ratio_tpot_{later}_vs_{earlier}"
                    row[key], row[f"{key}_interval"] = round(r.value, 3), r.as_list()
                    if len(calls) > 1:  # does a call reproduce the others?
                        each = [calls_ratio_interval([(c[later], c[earlier])]) for c in calls]
                        row[f"{key}_per_call"] = [
                            {"ratio": round(e.value, 3), "interval": e.as_list()} for e in each
                        ]
                    if r.relative_width > args.interval_bound:
                        refusals.append(
                            f"depth {depth}, batch {b}: {later} / {earlier} interval "
                            f"{r.as_list()} is wider than {args.interval_bound:.0%} of "
                            f"{r.value:.3f}"
                        )
            row["repeats"] = min(len(c[p]) for c in calls for p in parts)
            for p in parts:  # where each part's CPU went per step (benchmarks/thread_clock.py)
                threads = run["reports"][p].get("batches", {}).get(str(b), {})
                if threads.get("threads_per_step"):
                    row[f"threads_per_step_{p}"] = threads["threads_per_step"]
            row["tpot_ms_repeats"] = tpot if len(calls) == 1 else calls
            rows[f"batch_{b}"] = row
        for p in parts:
            if p.startswith("afd"):
                rows[f"{p}_exchange"] = run["reports"][p].get("afd_exchange", {})
                rows[f"{p}_timeline"] = run.get("timelines", {}).get(p, {})
            for key, profile in run.get("profiles", {}).items():
                if key.startswith(f"{p}_host_profile"):
                    rows[key] = profile
            retried = [r["reports"].get(p, {}).get("retried_repeats") for r in runs]
            if any(retried):
                rows[f"{p}_retried_repeats"] = retried[-1] if len(runs) == 1 else retried
        result[f"layers_{depth}"] = rows
    last = [runs[-1] for runs in depths.values()]
    afd_parts = [p for p in AFD_PARTS if all(p in r["tpot_ms"] for r in last)]
    colocated_in_all = all("colocated" in r["tpot_ms"] for r in last)
    if len(depths) >= 2 and colocated_in_all:
        for p in afd_parts:
            for b in batches:
                having = {
                    d: [r for r in runs if b in r["tpot_ms"].get(p, {})
                        and b in r["tpot_ms"].get("colocated", {})]
                    for d, runs in depths.items()
                }  # fmt: skip
                having = {d: runs for d, runs in having.items() if runs}
                if len(having) >= 2:
                    result[f"fit_{p}_batch_{b}"] = depth_fit(having, p, b)
    if refusals:
        result["refused"] = refusals
    return result


ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("cudagraph_mode", "kv_cache_bytes", "experts", "prompt_tokens", "tokens", "batches")
# Where a run's figures come from besides what it was asked: the code measured and the card.
# A state can be carried to a later session (its calls pooled with new ones); these make a
# pooled call of other code or another card visible (`settings_differ`).
PROVENANCE = ("source", "gpu", "driver", "host")
# The code a figure measures: the product's (a change to the harness that changes what is
# measured changes a setting too).
SOURCE_DIRS = ("afd_ctl", "afd_data", "vllm_ext")


def source_digest(root: Path = ROOT) -> str:
    """A short digest of every Python and proto file under SOURCE_DIRS (paths and contents),
    so two calls of the same code match whatever git knows (a copied tree, local changes)."""
    digest = hashlib.sha256()
    for top in SOURCE_DIRS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".proto"):
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def gpu_query(field: str) -> str | None:
    """The first GPU's `field` as nvidia-smi gives it (None without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def host_identity() -> str:
    """This machine: its host name and CPU model. Two machines of one card kind gave the same
    colocated TPOT and AFD figures 25 µs a layer apart (the fifteenth session's fit), and a
    host-paced step follows the CPU: pooled calls say which machine each ran on."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{socket.gethostname()} ({model or platform.processor() or 'cpu unknown'})"


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run was asked to do and what it ran (PROVENANCE), kept with it in --state (calls
    pooled later are compared)."""
    settings = {k: getattr(args, k) for k in SETTINGS if hasattr(args, k)}
    settings["source"] = source_digest()
    settings["host"] = host_identity()
    if args.gpu:
        settings["gpu"] = gpu_query("name")
        settings["driver"] = gpu_query("driver_version")
    return settings


def settings_that_differ(runs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each setting the pooled calls were not all run with alike: its value per call (None for
    a run from before settings were kept)."""
    per_key = {k: [r.get("settings", {}).get(k) for r in runs] for k in SETTINGS + PROVENANCE}
    return {k: v for k, v in per_key.items() if len({json.dumps(x) for x in v}) > 1}


def keep_logs(args: argparse.Namespace, tmp: Path, run: str) -> None:
    """With --log-dir, every process's log of this run (refused or not) is kept there, and
    the AFD parts' timelines (sampled, so a few MB at most) beside them."""
    if not args.log_dir:
        return
    into = Path(args.log_dir) / run.replace("+", "_").replace("@", "_depth").replace("#", "_call")
    into.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*.log"):
        shutil.copy2(log, into / log.name)
    if (tmp / "timeline").is_dir():
        shutil.copytree(tmp / "timeline", into / "timeline", dirs_exist_ok=True)


def call_key(parts: str, depth: int, call: int) -> str:
    """A run's key in --state: each set of parts' depths apart, a depth's later calls beside
    its first (whose key states written before --calls-per-depth have)."""
    return f"{parts}@{depth}" + (f"#{call}" if call > 1 else "")


def calls_of(state: dict[str, Any], parts: str, depth: int) -> list[dict[str, Any]]:
    runs = []
    while (run := state.get(call_key(parts, depth, len(runs) + 1))) is not None:
        runs.append(run)
    return runs


def next_depth(state: dict[str, Any], parts: str, wanted: list[int], calls: int) -> int | None:
    """The depth with the fewest calls, below `calls`: ascending in even rounds, descending in
    odd ones (4, 6, then 6, 4), so the calls of each depth are spread over the session."""
    done = {d: len(calls_of(state, parts, d)) for d in wanted}
    least = min(done.values())
    if least >= calls:
        return None
    order = wanted if least % 2 == 0 else wanted[::-1]
    return next(d for d in order if done[d] == least)


def main(args: argparse.Namespace) -> int:
    """Runs what --state lacks for these parts (each depth --calls-per-depth times; with
    --one-depth-per-call one run per call, to fit a per-call limit), then prints the
    comparison of what the state holds; exit 3 when refused."""
    state_path = Path(args.state)
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    wanted = [int(d) for d in args.depths.split(",")]
    parts = "+".join(parts_of(args))
    calls = max(1, getattr(args, "calls_per_depth", 1))
    started = time.monotonic()
    ran = 0
    while (depth := next_depth(state, parts, wanted, calls)) is not None:
        if args.one_depth_per_call and ran:
            break
        key = call_key(parts, depth, len(calls_of(state, parts, depth)) + 1)
        try:
            with tempfile.TemporaryDirectory(prefix="afd-e2e-il-") as tmp:
                try:
                    run = depth_run(args, depth, Path(tmp))
                finally:
                    keep_logs(args, Path(tmp), key)
        except BenchmarkRefused as exc:  # nonsense or late compiles: no figure of it is kept
            print(json.dumps({"benchmark": "e2e_decode", "depth": depth, "refused": [str(exc)]}))
            return 3
        run["tpot_ms"] = {
            p: {str(b): v for b, v in per.items()} for p, per in run["tpot_ms"].items()
        }
        run["wall_s"] = round(time.monotonic() - started, 1)
        run["settings"] = run_settings(args)
        state[key] = run
        state_path.write_text(json.dumps(state))
        ran += 1
    depths = {
        d: [{**run, "tpot_ms": {p: {int(b): v for b, v in per.items()}
                                for p, per in run["tpot_ms"].items()}}
            for run in runs]
        for d in wanted if (runs := calls_of(state, parts, d))
    }  # fmt: skip
    result = summarise(args, depths)
    if args.gpu:
        result.update(gpu_setup.mps_state(args.mps))
    result["depths_missing"] = [d for d in wanted if d not in depths]
    if any(len(runs) > 1 for runs in depths.values()) or calls > 1:
        result["calls_per_depth"] = {str(d): len(depths.get(d, [])) for d in wanted}
    print(json.dumps(result), flush=True)
    return 3 if "refused" in result else 0
