"""Decode timing inside one vLLM engine (offline LLM()), colocated or as the AFD attention
side; benchmarks/e2e_decode.py starts it once per part.

    python benchmarks/decode_runner.py MODEL --tokens N --repeats R --batches 1[,B...]
        [--llm-kwargs JSON] [--afd-controller HOST:PORT] [--ffn-log PATH] [--gpu]

Per batch size: one untimed warm-up of every batch size first (the same prompts and token
count as the timed runs, so every shape a timed run uses has run once: Triton JIT, autotuning,
allocations), then R timed repeats, batch sizes interleaved within each repeat so drift hits
all alike, each timed run right after an untimed 16-token run of the same batch. TPOT comes from vLLM's per-request timestamps (timing_stats says why), checked by
timing_stats.decode_run; the spread over repeats must stay within --spread-bound.

Compiles and graph captures inside a timed generate() refuse the run, where they can be seen:
new kernels in Triton's cache directories (TRITON_CACHE_DIR or its default, and those under
vLLM's cache root: every process of the host writes there, the FFN server too), the FFN
server's late graph captures (its log, --ffn-log), and vLLM's own compilation counters when
the engine runs in this process (CPU). vLLM itself raises on a CUDA graph capture outside its
capture phase, so a late capture there fails the run.

The last stdout line is one JSON object: the figures, or {"refused": REASON} (exit status 3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import thread_clock  # noqa: E402
from benchmarks.timing_stats import (  # noqa: E402
    BenchmarkRefused,
    DecodeRun,
    NotDecodedTogether,
    RequestTiming,
    bounded_spread,
    decode_run,
    late_events,
    positive,
    refuse_late_events,
)
from vllm_ext.testing.offline import DEFAULT_PROMPTS, LLM_KWARGS, apply_cpu_env  # noqa: E402

REFUSED_EXIT = 3
# An untimed run of the same batch right before each timed one (seen on an H200: the first
# timed repeat after another batch size's run was 20% slower than the rest).
SETTLE_TOKENS = 16
# Runs of one timed repeat at most, when its requests did not decode together (timed()).
REPEAT_ATTEMPTS = 3
# The FFN server's log line for a graph captured on a replay step (vllm_ext/exchange/nixl_graphs.py).
FFN_LATE_CAPTURE = "never captured here: capturing them now"
COUNTERS = ("num_backend_compilations", "num_inductor_compiles", "num_cudagraph_captured")


def triton_cache_dirs() -> list[Path]:
    """Where this host's processes write compiled Triton kernels: TRITON_CACHE_DIR (else
    Triton's default), and the triton_cache folders under vLLM's cache root, where vLLM points
    TRITON_CACHE_DIR inside a worker once it compiles (compiler_interface.initialize_cache).
    Listed after the warm-up, when those folders exist."""
    dirs = [Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")]
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    vllm_root = Path(os.environ.get("VLLM_CACHE_ROOT") or xdg / "vllm")
    if vllm_root.is_dir():
        dirs += sorted(vllm_root.glob("**/triton_cache"))
    return dirs


class LateEventCounters:
    """Snapshots of what grows when something compiles or captures."""

    def __init__(self, ffn_log: str) -> None:
        self.ffn_log = Path(ffn_log) if ffn_log else None
        self.caches = triton_cache_dirs()

    def cache_entries(self) -> set[str]:
        """Every entry of the Triton caches (one folder per compiled kernel)."""
        entries: set[str] = set()
        for cache in self.caches:
            try:
                entries.update(e.path for e in os.scandir(cache))
            except OSError:
                pass
        return entries

    @staticmethod
    def kernel_names(entries: set[str]) -> list[str]:
        """The kernels compiled into these cache entries (each holds NAME.json beside its
        binary), so a refusal says what compiled: fused_moe_kernel is the MoE side's,
        triton_poi_* / triton_red_* are torch.compile's (an attention or colocated engine)."""
        names = set()
        for entry in entries:
            try:
                names.update(
                    f.name[: -len(".json")] for f in os.scandir(entry)
                    if f.name.endswith(".json") and not f.name.startswith("__grp__")
                )  # fmt: skip
            except OSError:
                names.add(Path(entry).name)
        return sorted(names)

    def snapshot(self, entries: set[str]) -> dict[str, int]:
        """The counters now; `entries`: cache_entries() read just before (counted, not read
        again)."""
        counts: dict[str, int] = {"triton_kernels_compiled": len(entries)}
        if self.ffn_log is not None and self.ffn_log.is_file():
            text = self.ffn_log.read_text(errors="replace")
            counts["ffn_late_graph_captures"] = text.count(FFN_LATE_CAPTURE)
        try:  # meaningful only with the engine in this process (CPU, in-process)
            from vllm.compilation.counter import compilation_counter

            for name in COUNTERS:
                counts[f"vllm_{name}"] = int(getattr(compilation_counter, name, 0))
        except ImportError:
            pass
        return counts

    def sources(self) -> list[str]:
        seen = [f"triton caches {', '.join(map(str, self.caches))}",
                "vLLM compilation counters (in-process engine)"]  # fmt: skip
        if self.ffn_log is not None:
            seen.append("FFN server's late graph captures")
        return seen


def request_timings(outputs: list[Any]) -> list[RequestTiming]:
    timings = []
    for out in outputs:
        m = out.metrics
        if m is None or not getattr(m, "first_token_ts", 0.0):
            raise BenchmarkRefused(
                "vLLM returned no per-request timestamps (RequestOutput.metrics): "
                "the engine must log stats (disable_log_stats=False)"
            )
        timings.append(
            RequestTiming(
                first_token_s=m.first_token_ts,
                last_token_s=m.last_token_ts,
                output_tokens=len(out.outputs[0].token_ids),
                preemptions=int(getattr(m, "num_preemptions", 0) or 0),
            )
        )
    return timings


class MlpTimers:
    """Time inside the decoder layers' MLP/MoE modules, per forward step (CPU, in-process: for
    AFD that is the proxies' whole round trip to the FFN side)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._t0 = 0.0

    def install(self, model: Any) -> int:
        def pre(mod: Any, _args: Any) -> None:
            if mod is first:
                self.steps.append(0.0)
            self._t0 = time.perf_counter()

        def post(_mod: Any, _args: Any, _out: Any) -> None:
            if self.steps:
                self.steps[-1] += time.perf_counter() - self._t0

        layers = list(model.model.layers)
        first = layers[0].mlp
        for layer in layers:
            layer.mlp.register_forward_pre_hook(pre)
            layer.mlp.register_forward_hook(post)
        return len(layers)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.gpu:
        apply_cpu_env()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {**LLM_KWARGS, **json.loads(args.llm_kwargs)}
    kwargs["disable_log_stats"] = False  # RequestOutput.metrics carries the timestamps
    if args.afd_controller:
        kwargs["additional_config"] = {
            "afd": {"role": "attention", "controller": args.afd_controller}
        }
    afd = bool(kwargs.get("additional_config"))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.model, **kwargs)
    timers = MlpTimers() if args.mlp_timers else None
    if timers is not None:
        llm.apply_model(timers.install)

    def exchange_totals() -> tuple[float, float, float]:
        if not afd:
            return 0.0, 0.0, 0.0
        stats = llm.collective_rpc("afd_stats")[0]
        n = float(stats.get("exchanges", 0))
        return n, stats["post_us_per_layer"] * n / 1e3, stats["wait_us_per_layer"] * n / 1e3

    # Token ids, not text: the front end adds a batch's requests one by one while the engine
    # already steps, and tokenizing each on the way staggers their first tokens (seen on an
    # H200 at batch 256: decode tokens/s 12% below batch / TPOT).
    tokenizer = llm.get_tokenizer()
    prompts = {b: [{"prompt_token_ids": prompt_ids(tokenizer, i, args)} for i in range(b)]
               for b in batches}  # fmt: skip

    def generate(batch: int, n: int) -> tuple[list[Any], float]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts[batch], params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    for b in batches:  # every shape a timed run uses, once, before any timing
        generate(b, args.tokens)
        generate(b, 1)
    counters = LateEventCounters(args.ffn_log)
    runs: dict[int, list[DecodeRun]] = {b: [] for b in batches}
    exchange: dict[int, list[tuple[float, ...]]] = {b: [] for b in batches}
    mlp: dict[int, list[float]] = {b: [] for b in batches}
    threads: dict[int, list[dict[str, Any]]] = {b: [] for b in batches}  # thread_clock
    tokens: dict[int, list[list[int]]] = {}
    same_tokens = True
    retried: list[str] = []

    def timed(b: int, r: int) -> DecodeRun:
        """One timed repeat of batch `b`, right after an untimed settle run of the same batch.
        A run whose requests did not decode together is taken again (at most
        REPEAT_ATTEMPTS runs), each such run named in the report's `retried_repeats`."""
        nonlocal same_tokens
        what = f"batch {b}, repeat {r}"
        for attempt in range(1, REPEAT_ATTEMPTS + 1):
            generate(b, SETTLE_TOKENS)  # the timed run never follows another batch directly
            x0 = exchange_totals()
            cached = counters.cache_entries()
            before = counters.snapshot(cached)
            if timers is not None:
                timers.steps.clear()
            labels = thread_clock.tree_labels(os.getpid(), args.ffn_pid)
            threads_before = thread_clock.snapshot(labels)
            outs, wall = generate(b, args.tokens)
            threads_after = thread_clock.snapshot(labels)
            now = counters.cache_entries()
            after = counters.snapshot(now)
            refuse_late_events(
                late_events(before, after), what, counters.kernel_names(now - cached)
            )
            timings = request_timings(outs)
            stagger_ms = 1e3 * (max(t.first_token_s for t in timings)
                                - min(t.first_token_s for t in timings))  # fmt: skip
            print(f"{what}: wall {wall:.3f} s, first tokens within {stagger_ms:.1f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
            try:
                run = decode_run(timings, args.tokens, wall, what)
                break
            except NotDecodedTogether as exc:
                if attempt == REPEAT_ATTEMPTS:
                    raise
                last_tokens_ms = 1e3 * (max(t.last_token_s for t in timings)
                                        - min(t.last_token_s for t in timings))  # fmt: skip
                retried.append(f"{exc} (first tokens within {stagger_ms:.1f} ms, last within "
                               f"{last_tokens_ms:.1f} ms); taken again")  # fmt: skip
                print(retried[-1], file=sys.stderr, flush=True)
        runs[b].append(run)
        threads[b].append(thread_clock.per_step(threads_before, threads_after, args.tokens))
        print(f"{what}: TPOT {1e3 * run.tpot_s:.3f} ms, {run.tokens_per_s:.1f} decode tokens/s",
              file=sys.stderr, flush=True)  # fmt: skip
        if timers is not None:
            mlp[b].append(statistics.median(timers.steps))
        ids = [list(o.outputs[0].token_ids) for o in outs]
        same_tokens = same_tokens and tokens.get(b, ids) == ids
        tokens[b] = ids
        if afd:  # the exchange per decode step: the N-token run less a 1-token run
            xn = tuple(a - c for a, c in zip(exchange_totals(), x0, strict=True))
            x1_start = exchange_totals()
            generate(b, 1)
            x1 = tuple(a - c for a, c in zip(exchange_totals(), x1_start, strict=True))
            exchange[b].append(
                tuple((n - one) / (args.tokens - 1) for n, one in zip(xn, x1, strict=True))
            )
        return run

    if args.lockstep:
        lockstep(timed)
    else:
        for r in range(args.repeats):
            for b in batches:
                timed(b, r)

    report: dict[str, Any] = {
        "batches": {},
        "tokens_same_across_repeats": same_tokens,
        "late_events_checked": counters.sources(),
        "spread_bound": args.spread_bound,
        "retried_repeats": retried,
    }
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    report["cudagraph_mode_effective"] = getattr(mode, "name", str(mode))
    gpu_driven = afd and bool(llm.collective_rpc("afd_stats")[0].get("gpu_driven"))
    # In lockstep the driver interleaves the parts and reports intervals: no spread refusal.
    bound = math.inf if args.lockstep else args.spread_bound
    for b in batches:
        if not runs[b]:
            continue
        tpot = bounded_spread([1e3 * x.tpot_s for x in runs[b]], bound, f"batch {b}: TPOT (ms)")
        tps = bounded_spread(
            [x.tokens_per_s for x in runs[b]], bound, f"batch {b}: decode tokens/s"
        )
        row: dict[str, Any] = {
            "tpot_ms": tpot.as_dict(4),
            "decode_tokens_per_s": tps.as_dict(1),
            "tpot_ms_repeats": [round(1e3 * x.tpot_s, 4) for x in runs[b]],
            "token_ids": tokens[b],
        }
        if any(threads[b]):  # per decode step of the timed runs, its prefill included
            row["threads_per_step"] = thread_clock.median_per_step(threads[b])
        if mlp[b]:
            row["mlp_ms_per_step"] = round(
                1e3 * positive(statistics.median(mlp[b]), f"batch {b}: MLP time"), 4
            )
        if exchange[b]:
            n, post, wait = (statistics.median(col) for col in zip(*exchange[b], strict=True))
            row["exchanges_per_step"] = round(n, 2)
            if post == 0 and gpu_driven:  # the host only enqueues: no per-layer post time
                row["exchange_host_timers"] = "no post per decode step: GPU-driven exchange"
                row["exchange_wait_ms_per_step"] = round(wait, 4)
            else:
                row["exchange_post_ms_per_step"] = round(positive(post, f"batch {b}: post"), 4)
                row["exchange_wait_ms_per_step"] = round(positive(wait, f"batch {b}: wait"), 4)
        report["batches"][str(b)] = row
    if afd:
        report["afd_exchange"] = llm.collective_rpc("afd_stats")[0]
    return report


def prompt_ids(tokenizer: Any, i: int, args: argparse.Namespace) -> list[int]:
    """Request i's prompt: with --prompt-tokens N, N random token ids of its own (every request
    distinct, every prompt the same length, so the prefill shapes of a batch size repeat);
    else a text prompt."""
    if not args.prompt_tokens:
        return list(tokenizer.encode(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] + f" {i}"))
    rng = random.Random(1000 + i)
    vocab = len(tokenizer)
    return [rng.randrange(16, vocab - 1) for _ in range(args.prompt_tokens)]


def lockstep(timed: Any) -> None:
    """A driver (benchmarks/interleave.py) runs this engine's timed repeats one at a time,
    interleaved with other engines': after the warm-ups it says {"ready": true}, then each
    stdin line {"batch": B, "repeat": R} runs one timed repeat and answers {"run": {...}}, and
    {"done": true} ends the loop (the report follows as usual)."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("done"):
            return
        run = timed(int(command["batch"]), int(command["repeat"]))
        print(json.dumps({"run": {"batch": command["batch"], "tpot_ms": 1e3 * run.tpot_s,
                                  "tokens_per_s": run.tokens_per_s}}), flush=True)  # fmt: skip
    raise BenchmarkRefused("the driver closed stdin without saying done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", default="1")
    parser.add_argument("--llm-kwargs", default="{}", help="JSON: LLM() arguments to override")
    parser.add_argument("--afd-controller", default="")
    parser.add_argument("--ffn-log", default="", help="the FFN server's log (late captures)")
    parser.add_argument("--ffn-pid", type=int, default=0,
                        help="the FFN server's process: its threads' CPU per step too")  # fmt: skip
    parser.add_argument("--gpu", action="store_true", help="no CPU environment settings")
    parser.add_argument("--mlp-timers", action="store_true", help="CPU: time the MLP modules")
    parser.add_argument("--spread-bound", type=float, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="distinct random prompts of this many tokens (default: text)")  # fmt: skip
    parser.add_argument(
        "--lockstep", action="store_true",
        help="timed repeats one at a time, as a driver on stdin says (benchmarks/interleave.py)",
    )  # fmt: skip
    args = parser.parse_args()
    try:
        report = run(args)
    except BenchmarkRefused as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({"refused": str(exc)}), flush=True)
        sys.exit(REFUSED_EXIT)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
