"""Greedy generation with vLLM's in-process LLM(), colocated or as the AFD attention side.

    python -m vllm_ext.testing.offline MODEL_DIR [--afd-controller HOST:PORT] [--json OUT]

Without --afd-controller this is the reference every AFD run must match; with it, the same
engine runs as the AFD attention role (its FFN half on the FFN servers afd-ctl routes to).
The last stdout line is one JSON object: {"results": [...], "generate_s": ..., "init_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot",
    "Hello, my name is",
]

# vLLM on CPU, reproducibly (the README's serving recipe gives the same settings):
# VLLM_HOST_IP skips vLLM's lookup of this host's network address; VLLM_CPU_KVCACHE_SPACE is
# the KV cache in GiB (vLLM's default asks for more memory than a small machine has);
# one OpenMP thread, unbound, for the same greedy outputs in every process; no hub lookups.
TIMINGS: dict[str, float] = {}

CPU_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _installed_vllm_line() -> str:
    """'0.26' or '0.32', read from the distribution metadata (vLLM itself is not imported)."""
    import importlib.metadata

    try:
        return ".".join(importlib.metadata.version("vllm").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return ""


if _installed_vllm_line() == "0.26":
    # vLLM 0.26's CPU platform has no MLA backend: DeepSeek runs there with standard attention
    # (colocated and AFD alike, so their tokens still compare). MLA on 0.26 is checked on GPU.
    CPU_ENV["VLLM_MLA_DISABLE"] = "1"


# vLLM 0.32 prefers its AMX MLA backend on CPUs with AMX tiles, and that backend takes bf16,
# fp16 or int8 weights only: these float32 runs ask for its reference CPU MLA backend instead
# (a model without MLA ignores the setting). 0.26 has no MLA on CPU (VLLM_MLA_DISABLE above).
CPU_ATTENTION_BACKEND = "CPU_MLA" if _installed_vllm_line() == "0.32" else None

# The engine settings of every offline run (the same as procs.ENGINE_FLAGS for `vllm serve`).
LLM_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "seed": 0,
}
if CPU_ATTENTION_BACKEND:
    LLM_KWARGS["attention_backend"] = CPU_ATTENTION_BACKEND


def _offline_classes() -> tuple[Any, Any]:
    """vLLM's LLM and SamplingParams, through compat (the one place that imports vLLM)."""
    from vllm_ext import compat

    return compat.seams().offline_llm_classes()


def apply_cpu_env(overrides: dict[str, str] | None = None) -> None:
    """Sets CPU_ENV (then overrides) in os.environ unless already set; call before importing vLLM."""
    for key, value in {**CPU_ENV, **(overrides or {})}.items():
        os.environ.setdefault(key, value)


def generate(
    model: str,
    prompts: list[str] | None = None,
    max_tokens: int = 16,
    logprobs: int = 1,
    **llm_kwargs: Any,
) -> list[dict[str, Any]]:
    """Runs LLM(model).generate greedily; returns per prompt its token ids, text and the
    log-prob of each chosen token."""
    return generate_and_answer(model, prompts, max_tokens, logprobs, [], **llm_kwargs)[0]


ANSWERED_FIELDS = {"prompt", "messages", "max_tokens", "temperature", "ignore_eos"}


def check_requests(requests: list[dict[str, Any]]) -> None:
    """Refuses, before any engine starts, a body `answer` would not answer as `vllm serve`
    does: each names `prompt` or `messages`, `max_tokens`, and `temperature` 0 (a server's
    default temperature is not greedy), and nothing else."""
    for i, body in enumerate(requests):
        unknown = sorted(set(body) - ANSWERED_FIELDS)
        missing = sorted({"max_tokens", "temperature"} - set(body))
        kinds = [k for k in ("prompt", "messages") if k in body]
        if unknown or missing or len(kinds) != 1 or body["temperature"] != 0:
            raise ValueError(
                f"request {i}: only greedy completions or chats are answered (prompt or "
                f"messages, max_tokens, temperature 0, ignore_eos): unknown {unknown}, "
                f"missing {missing}, temperature {body.get('temperature')!r}"
            )


def answer(llm: Any, sampling_params: Any, requests: list[dict[str, Any]]) -> list[str]:
    """What a `vllm serve` of the same engine answers to each OpenAI request body (`prompt`: a
    completion, `messages`: a chat; `check_requests` says which), each alone in its batch and
    with an empty prefix cache, as a client asking one at a time gets it: the answers' texts."""
    if requests:
        llm.reset_prefix_cache()  # nothing of the reference's own generation is reused
    texts = []
    for body in requests:
        params = sampling_params(
            temperature=0.0, max_tokens=body["max_tokens"], ignore_eos=body.get("ignore_eos", False)
        )
        if "messages" in body:
            out = llm.chat(body["messages"], params, use_tqdm=False)
        else:
            out = llm.generate([body["prompt"]], params, use_tqdm=False)
        texts.append(out[0].outputs[0].text)
    return texts


def generate_and_answer(
    model: str,
    prompts: list[str] | None,
    max_tokens: int,
    logprobs: int,
    requests: list[dict[str, Any]],
    **llm_kwargs: Any,
) -> tuple[list[dict[str, Any]], list[str]]:
    """generate's results, then the answers to `requests` from the same engine (`answer`;
    `requests` checked before the engine starts)."""
    check_requests(requests)
    apply_cpu_env()
    LLM, SamplingParams = _offline_classes()

    kwargs = {**LLM_KWARGS, **llm_kwargs}
    t0 = time.perf_counter()
    llm = LLM(model=model, **kwargs)
    t1 = time.perf_counter()
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True
    )
    outputs = llm.generate(prompts or DEFAULT_PROMPTS, params)
    t2 = time.perf_counter()
    TIMINGS.update(init_s=t1 - t0, generate_s=t2 - t1)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        lps = [step[tok].logprob for tok, step in zip(ids, completion.logprobs or [], strict=False)]
        results.append(
            {"prompt": out.prompt, "token_ids": ids, "text": completion.text, "logprobs": lps}
        )
    answers = answer(llm, SamplingParams, requests)
    del llm
    return results, answers


def bench_decode(
    model: str, decode_tokens: int, repeats: int, batch: int, **llm_kwargs: Any
) -> dict[str, Any]:
    """Time per output token of greedy decode: (t(N tokens) - t(1 token)) / (N - 1), best of
    `repeats`; also the time spent inside the decoder layers' MLP/MoE modules (for AFD: the
    proxies, i.e. the whole round trip to the FFN side) per decode step."""
    apply_cpu_env()
    LLM, SamplingParams = _offline_classes()

    kwargs = {**LLM_KWARGS, **llm_kwargs}
    llm = LLM(model=model, **kwargs)
    mlp_s = [0.0]

    def add_timers(m: Any) -> int:
        def pre(_mod: Any, _args: Any) -> None:
            _mod._afd_t0 = time.perf_counter()

        def post(_mod: Any, _args: Any, _out: Any) -> None:
            mlp_s[0] += time.perf_counter() - _mod._afd_t0

        for layer in m.model.layers:
            layer.mlp.register_forward_pre_hook(pre)
            layer.mlp.register_forward_hook(post)
        return len(m.model.layers)

    llm.apply_model(add_timers)
    prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(batch)]

    def timed(n: int) -> tuple[float, float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        mlp_s[0] = 0.0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, mlp_s[0], [list(o.outputs[0].token_ids) for o in outs]

    timed(4)  # warm-up
    best: tuple[float, float] | None = None
    tokens: list[list[int]] = []
    for _ in range(repeats):
        t1, m1, _ = timed(1)
        tn, mn, tokens = timed(decode_tokens)
        tpot = (tn - t1) / (decode_tokens - 1)
        mlp = (mn - m1) / (decode_tokens - 1)
        if best is None or tpot < best[0]:
            best = (tpot, mlp)
    assert best is not None
    report = {
        "tpot_ms": best[0] * 1e3,
        "mlp_ms_per_step": best[1] * 1e3,
        "token_ids": tokens,
    }
    if llm_kwargs.get("additional_config"):  # AFD: the exchange's own split, rank 0
        report["afd_exchange"] = llm.collective_rpc("afd_stats")[0]
    return report


def bench_decode_batches(
    model: str, decode_tokens: int, repeats: int, batches: list[int], **llm_kwargs: Any
) -> dict[str, Any]:
    """GPU decode speed at several batch sizes in one engine (CUDA graphs stay on, so no module
    timers): per batch, TPOT = (t(N) - t(1)) / (N - 1), best of `repeats`, decode tokens/s, and
    for AFD the exchange's own timers per decode step (post: staging and posting the rows;
    wait: until the FFN's output is back, i.e. FFN compute plus the two hops)."""
    LLM, SamplingParams = _offline_classes()

    llm = LLM(model=model, **{**LLM_KWARGS, **llm_kwargs})
    afd = bool(llm_kwargs.get("additional_config"))

    def exchange_totals() -> tuple[float, float, float]:
        if not afd:
            return 0.0, 0.0, 0.0
        stats = llm.collective_rpc("afd_stats")[0]
        n = float(stats.get("exchanges", 0))
        return n, stats["post_us_per_layer"] * n / 1e3, stats["wait_us_per_layer"] * n / 1e3

    def timed(prompts: list[str], n: int) -> tuple[float, tuple[float, ...], list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        before = exchange_totals()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = exchange_totals()
        spent = tuple(a - b for a, b in zip(after, before, strict=True))
        return elapsed, spent, [list(o.outputs[0].token_ids) for o in outs]

    report: dict[str, Any] = {"batches": {}}
    for batch in batches:
        prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] + f" {i}" for i in range(batch)]
        timed(prompts, 4)  # warm-up
        best: tuple[float, tuple[float, ...]] | None = None
        tokens: list[list[int]] = []
        for _ in range(repeats):
            t1, x1, _ = timed(prompts, 1)
            tn, xn, tokens = timed(prompts, decode_tokens)
            tpot = (tn - t1) / (decode_tokens - 1)
            per_step = tuple((b - a) / (decode_tokens - 1) for a, b in zip(x1, xn, strict=True))
            if best is None or tpot < best[0]:
                best = (tpot, per_step)
        assert best is not None
        row: dict[str, Any] = {
            "tpot_ms": best[0] * 1e3,
            "decode_tokens_per_s": batch / best[0],
            "token_ids": tokens,
        }
        if afd:
            row["exchange_post_ms_per_step"] = best[1][1]
            row["exchange_wait_ms_per_step"] = best[1][2]
            row["exchanges_per_step"] = best[1][0]
        report["batches"][str(batch)] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--afd-controller", default="")
    parser.add_argument("--prompts", type=int, default=len(DEFAULT_PROMPTS))
    parser.add_argument("--json", default="", help="also write the report to this file")
    parser.add_argument(
        "--answer",
        default="",
        metavar="FILE",
        help="JSON list of OpenAI request bodies to answer after generating, each alone, as "
        "`vllm serve` of this engine would (the report's `answers`)",
    )
    parser.add_argument(
        "--bench-decode", type=int, default=0, metavar="N", help="time N-token greedy decode"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="GPU engine: no CPU settings; --batches and --llm-kwargs apply",
    )
    parser.add_argument("--batches", default="", help="with --bench-decode: e.g. 16,64,256")
    parser.add_argument("--llm-kwargs", default="{}", help="JSON: LLM() arguments to override")
    args = parser.parse_args()
    kwargs: dict[str, Any] = json.loads(args.llm_kwargs)
    if not args.gpu:
        apply_cpu_env()
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.afd_controller:
        kwargs["additional_config"] = {
            "afd": {"role": "attention", "controller": args.afd_controller}
        }
    if args.bench_decode and args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        report = bench_decode_batches(
            args.model, args.bench_decode, args.repeats, batches, **kwargs
        )
        print(json.dumps(report), flush=True)
        return
    if args.bench_decode:
        report = bench_decode(args.model, args.bench_decode, args.repeats, args.batch, **kwargs)
        print(json.dumps(report), flush=True)
        return
    prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(args.prompts)]
    requests = json.loads(Path(args.answer).read_text()) if args.answer else []
    results, answers = generate_and_answer(
        args.model, prompts, args.max_tokens, 1, requests, **kwargs
    )
    report = {"results": results, **TIMINGS}
    if args.answer:
        report["answers"] = answers
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
