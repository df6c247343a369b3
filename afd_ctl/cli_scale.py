"""`afd-ctl scale`: set a target membership (issue 37) and, with --wait, follow it to its new
epoch or its end."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from afd_ctl.cli_text import topology_label
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.wire import enum_name

POLL_S = 0.2


def add_scale_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    scale = sub.add_parser(
        "scale",
        help="change the number of attention and FFN workers of a running deployment",
        description="Set the target membership: M attention and N FFN workers, in FFN groups "
        "of E (default: min(M, N) groups). The current epoch keeps serving while new workers "
        "register and leaving attention workers drain; then attention workers hold between "
        "steps, leaving workers are retired and the daemon moves to a new epoch with the new "
        "routing. One change at a time: another scale while one is in progress is refused, "
        "except a scale to the current membership, which cancels it. A target the routing "
        "cannot serve is refused in one line naming the rule.",
    )
    scale.add_argument("--attention", type=int, required=True, metavar="M")
    scale.add_argument("--ffn", type=int, required=True, metavar="N")
    scale.add_argument(
        "--expert-parallel-size",
        type=int,
        default=0,
        metavar="E",
        help="FFN workers per group (E divides N, N / E <= M); default: min(M, N) groups",
    )
    scale.add_argument("--reason", default="", help="recorded in the TARGET_SET event")
    scale.add_argument(
        "--wait-s",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the new epoch (exit 3 if it has not come, or the "
        "change was given up); 0: return at once",
    )
    return scale


def run_scale(
    stub: afd_pb2_grpc.AFDInspectStub, args: argparse.Namespace, metadata: Sequence[tuple[str, str]]
) -> int:
    reply = stub.Scale(
        afd_pb2.ScaleRequest(
            attention=args.attention,
            ffn=args.ffn,
            expert_parallel_size=args.expert_parallel_size,
            reason=args.reason,
        ),
        timeout=args.timeout,
        metadata=metadata,
    )
    print(f"{topology_label(reply.current)}: {reply.message}")
    if not reply.HasField("target") or args.wait_s <= 0:
        return 0
    deadline = time.monotonic() + args.wait_s
    said = ""
    while time.monotonic() < deadline:
        status = stub.GetStatus(afd_pb2.GetStatusRequest(), timeout=args.timeout, metadata=metadata)
        if not status.HasField("change"):
            print(status.last_change)
            return 0 if status.last_change.startswith("scaled") else 3
        waiting = "; ".join(status.change.waiting_for) or "moving"
        if waiting != said:
            print(
                f"  {enum_name(afd_pb2.ScaleChange.Phase, status.change.phase).lower()}: {waiting}"
            )
            said = waiting
        time.sleep(POLL_S)
    print(
        f"afd-ctl scale: not done after {args.wait_s:.0f} s (afd-ctl status shows the change)",
        file=sys.stderr,
    )
    return 3
