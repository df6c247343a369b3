"""`afd-ctl advise | trace`: the client side of the daemon's timing book."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

if TYPE_CHECKING:
    from afd_ctl.advice import Advice

Metadata = tuple[tuple[str, str], ...]


def run_advise(
    stub: afd_pb2_grpc.AFDInspectStub, args: argparse.Namespace, metadata: Metadata
) -> int:
    from afd_ctl.advice import AdviceRefused, advise

    timings = stub.GetTimings(afd_pb2.GetTimingsRequest(), timeout=args.timeout, metadata=metadata)
    try:
        advice = advise(timings)
    except AdviceRefused as exc:
        if args.json:
            print(json.dumps({"refused": str(exc)}))
        print(f"afd-ctl advise: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(finite(advice.to_dict()), indent=2))
    else:
        print(format_advice(advice))
    return 0


def finite(value: Any) -> Any:
    """`value` with every infinite or undefined float as None (A* is infinite when the FFN
    never limits), so `--json` stays strict JSON for scripts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def format_advice(advice: Advice) -> str:
    i = advice.inputs
    lines = [
        f"bottleneck   {advice.bottleneck} side: {advice.why}",
        f"formula      {advice.formula}",
        f"inputs       M={i['M_attention_workers']:.0f} N={i['N_ffn_workers']:.0f} "
        f"b={i['b_tokens_per_attention_step']:.1f} tokens L={i['L_layers']:.0f} "
        f"T_a(b)={i['T_a_ms_per_layer']:.3f} ms c0={i['c0_ms_per_layer']:.3f} ms "
        f"c1={i['c1_us_per_token_per_layer']:.3f} us/token "
        f"(from {i['attention_steps']:.0f} attention and {i['ffn_steps']:.0f} FFN steps)",
        f"balance      A* = {advice.balanced_ratio:.2f} attention per FFN worker "
        f"(90% interval {advice.balanced_ratio_interval[0]:.2f} to "
        f"{advice.balanced_ratio_interval[1]:.2f}{', noisy' if advice.noisy else ''}); "
        f"best candidate {advice.recommended}",
        "",
        f"{'RATIO':>7} {'LAYER MS':>9} {'BOTTLENECK':>10} {'TOKENS/S/GPU':>13}",
    ]
    for c in advice.candidates:
        lines.append(
            f"{c.attention:>5}:{c.ffn:<1} {c.layer_ms:>9.3f} {c.bottleneck:>10} "
            f"{c.tokens_per_s_per_gpu:>13.1f}"
        )
    lines += ["", "assumptions"] + [f"  - {a}" for a in advice.assumptions]
    if advice.notes:
        lines += ["notes"] + [f"  - {n}" for n in advice.notes]
    return "\n".join(lines)


def out_path_problem(path: str) -> str:
    """Why `path` cannot take the trace ("" when it can), found by opening it for appending:
    nothing is written, and a file this creates is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return (
            f"cannot write --out {path}: {exc.strerror or exc}; give a file in a writable "
            "directory (nothing was recorded)"
        )
    if not existed:
        os.unlink(path)
    return ""


def run_trace(
    stub: afd_pb2_grpc.AFDInspectStub, args: argparse.Namespace, metadata: Metadata
) -> int:
    from afd_ctl.trace import to_chrome

    result = stub.Trace(
        afd_pb2.TraceRequest(steps=args.steps, timeout_s=args.wait_s),
        timeout=args.wait_s + args.timeout,
        metadata=metadata,
    )
    with open(args.out, "w") as f:
        json.dump(to_chrome(result), f)
    spans = sum(len(w.spans) for w in result.workers)
    print(
        f"wrote {args.out}: steps {result.first_step_id}..{result.first_step_id + result.steps - 1}, "
        f"{len(result.workers)} worker(s), {spans} spans"
    )
    for w in result.workers:
        print(
            f"  {w.worker.worker_id}: clock offset {w.offset_s * 1e6:+.0f} us "
            f"+- {w.offset_error_s * 1e6:.0f} us"
        )
    if result.missing:
        print(f"  no answer from: {', '.join(result.missing)}")
    for problem in result.problems:
        print(f"  left out: {problem}")
    return 0
