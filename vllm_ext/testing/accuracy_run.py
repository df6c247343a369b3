"""One side of the accuracy gate (vllm_ext.testing.accuracy_gate) as vLLM's in-process LLM():
greedy generation from fixed prompts, then the teacher-forced scoring of a continuation.

    python -m vllm_ext.testing.accuracy_run MODEL_DIR --out RUN.json [--reference REF.json]
        [--compiled] [--afd-controller HOST:PORT] [--prompts 32] [--tokens 64]

Without --reference the run is a reference: it draws the prompts, generates, and scores its
own continuation. With it, the run takes the reference's prompts, generates from them (for the
free-running divergence) and scores the reference's continuation. --compiled drops
enforce_eager (torch.compile; on CPU there are no CUDA graphs). The last stdout line is one
JSON object with the file written and the timings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from vllm_ext.testing.accuracy_gate import position_scores, prompt_token_ids
from vllm_ext.testing.offline import LLM_KWARGS, _offline_classes, apply_cpu_env


def run(
    model: str,
    prompts: list[list[int]],
    continuations: list[list[int]] | None,
    tokens: int,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Generates `tokens` greedily from each prompt, then scores `continuations` (this run's
    own generation when None) after each prompt with prompt_logprobs."""
    LLM, SamplingParams = _offline_classes()
    t0 = time.perf_counter()
    llm = LLM(model=model, **{**LLM_KWARGS, **llm_kwargs})
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
    del llm
    return {
        "prompt_ids": prompts,
        "generated": generated,
        "scored": scored,
        "logprobs": logprobs,
        "top1": top1,
        "init_s": t1 - t0,
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
    args = parser.parse_args()
    apply_cpu_env()
    kwargs: dict[str, Any] = {"enforce_eager": not args.compiled}
    if args.afd_controller:
        kwargs["additional_config"] = {
            "afd": {"role": "attention", "controller": args.afd_controller}
        }
    if args.reference:
        reference = json.loads(Path(args.reference).read_text())
        prompts, continuations = reference["prompt_ids"], reference["generated"]
        tokens = len(continuations[0])
    else:
        config = json.loads((Path(args.model) / "config.json").read_text())
        prompts = prompt_token_ids(args.prompts, config["vocab_size"], max_len=args.max_prompt_len)
        continuations, tokens = None, args.tokens
    report = run(args.model, prompts, continuations, tokens, **kwargs)
    report["mode"] = "compiled" if args.compiled else "eager"
    Path(args.out).write_text(json.dumps(report))
    timings = {k: round(report[k], 2) for k in ("init_s", "generate_s", "score_s")}
    print(json.dumps({"out": args.out, **timings}), flush=True)


if __name__ == "__main__":
    main()
