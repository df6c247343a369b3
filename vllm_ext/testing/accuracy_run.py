"""One side of the accuracy gate (vllm_ext.testing.accuracy_gate) as vLLM's in-process LLM():
greedy generation from fixed prompts, then the teacher-forced scoring of a continuation.

    python -m vllm_ext.testing.accuracy_run MODEL_DIR --out RUN.json [--reference REF.json]
        [--compiled] [--afd-controller HOST:PORT] [--prompts 32] [--tokens 64]
        [--again-out RUN2.json] [--reference-after-go]

Without --reference the run is a reference: it draws the prompts, generates, and scores its
own continuation. With it, the run takes the reference's prompts, generates from them (for the
free-running divergence) and scores the reference's continuation. --compiled drops
enforce_eager (torch.compile; on CPU there are no CUDA graphs). Each run's stdout line is one
JSON object with the file written and the timings. --again-out: after the first run, wait for
a line on stdin, then run again on the same engine (and the same AFD servers) into RUN2.json.
--reference-after-go: build the engine first (torch.compile's minute with --compiled), then
wait for a line on stdin before reading the reference (a caller starts this run beside the one
that writes the reference).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_ext.testing.accuracy_gate import position_scores, prompt_token_ids
from vllm_ext.testing.offline import LLM_KWARGS, _offline_classes, apply_cpu_env


def run(
    llm: Any,
    prompts: list[list[int]],
    continuations: list[list[int]] | None,
    tokens: int,
) -> dict[str, Any]:
    """Generates `tokens` greedily from each prompt on `llm` (an LLM()), then scores
    `continuations` (this run's own generation when None) after each prompt with
    prompt_logprobs."""
    _, SamplingParams = _offline_classes()
    t1 = time.perf_counter()
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    generated = [list(o.outputs[0].token_ids) for o in outs]
    scored = generated if continuations is None else continuations
    t2 = time.perf_counter()
    # One more token, so that vLLM has something to generate; only the prompt's scores count.
    score = SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True, detokenize=False
    )
    full = [{"prompt_token_ids": p + c} for p, c in zip(prompts, scored, strict=True)]
    outs = llm.generate(full, score, use_tqdm=False)
    t3 = time.perf_counter()
    logprobs, top1 = [], []
    for prompt, cont, out in zip(prompts, scored, outs, strict=True):
        lps, tops = position_scores(list(out.prompt_logprobs)[len(prompt) :], cont)
        logprobs.append(lps)
        top1.append(tops)
    return {
        "prompt_ids": prompts,
        "generated": generated,
        "scored": scored,
        "logprobs": logprobs,
        "top1": top1,
        "generate_s": t2 - t1,
        "score_s": t3 - t2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", default="", help="a reference run's JSON")
    parser.add_argument("--compiled", action="store_true", help="torch.compile, not eager")
    parser.add_argument("--afd-controller", default="")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--again-out", default="", help="a second run's JSON (see above)")
    parser.add_argument(
        "--reference-after-go", action="store_true", help="read --reference after a stdin line"
    )
    args = parser.parse_args()
    apply_cpu_env()
    kwargs: dict[str, Any] = {"enforce_eager": not args.compiled}
    if args.afd_controller:
        kwargs["additional_config"] = {
            "afd": {"role": "attention", "controller": args.afd_controller}
        }
    LLM, _ = _offline_classes()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **{**LLM_KWARGS, **kwargs})
    init_s = time.perf_counter() - t0
    if args.reference_after_go and not sys.stdin.readline():
        raise SystemExit("accuracy_run: stdin closed before the go to read the reference")
    if args.reference:
        reference = json.loads(Path(args.reference).read_text())
        prompts, continuations = reference["prompt_ids"], reference["generated"]
        tokens = len(continuations[0])
    else:
        config = json.loads((Path(args.model) / "config.json").read_text())
        prompts = prompt_token_ids(args.prompts, config["vocab_size"], max_len=args.max_prompt_len)
        continuations, tokens = None, args.tokens

    def one_run(out: str) -> None:
        report = {**run(llm, prompts, continuations, tokens), "init_s": init_s}
        report["mode"] = "compiled" if args.compiled else "eager"
        Path(out).write_text(json.dumps(report))
        timings = {k: round(report[k], 2) for k in ("init_s", "generate_s", "score_s")}
        print(json.dumps({"out": out, **timings}), flush=True)

    one_run(args.out)
    if args.again_out and sys.stdin.readline():  # the caller's go ("": its stdin closed)
        one_run(args.again_out)


if __name__ == "__main__":
    main()
