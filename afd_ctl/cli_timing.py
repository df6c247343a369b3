"""`afd-ctl advise | trace`: the client side of the daemon's timing book."""

from __future__ import annotations

import argparse
import json
import os
import sys

from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

Metadata = tuple[tuple[str, str], ...]


def run_advise(
    stub: afd_pb2_grpc.AFDInspectStub, args: argparse.Namespace, metadata: Metadata
) -> int:
    from afd_ctl.advice import AdviceRefused, advise, format_advice

    timings = stub.GetTimings(afd_pb2.GetTimingsRequest(), timeout=args.timeout, metadata=metadata)
    try:
        advice = advise(timings)
    except AdviceRefused as exc:
        if args.json:
            print(json.dumps({"refused": str(exc)}))
        print(f"afd-ctl advise: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(advice.to_dict(), indent=2) if args.json else format_advice(advice))
    return 0


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
