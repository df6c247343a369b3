"""`afd-ctl scale`: set a target membership (issue 37) and, with --wait, follow it to its new
epoch or its end."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import grpc

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
        "change was given up), asking again while the daemon does not answer within "
        "--timeout; 0: ask once and return",
    )
    return scale


def unanswered(exc: grpc.RpcError) -> bool:
    """The daemon took the call or the connection but did not answer in time (a daemon whose
    event loop is held accepts TCP connections and never sends HTTP/2's SETTINGS); not an
    address where nothing listens, or that does not resolve."""
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return code == grpc.StatusCode.UNAVAILABLE and "timed out" in (exc.details() or "")


def ask_scale(
    stub: afd_pb2_grpc.AFDInspectStub,
    args: argparse.Namespace,
    metadata: Sequence[tuple[str, str]],
    deadline: float,
) -> tuple[afd_pb2.ScaleResponse, bool]:
    """The Scale call and whether it was asked more than once. With --wait-s it is asked again
    until `deadline` while the daemon does not answer within --timeout (`unanswered`: a busy
    or starved daemon drops a call whose deadline passes before it runs it). Asking again is
    safe: the same target answers "already moving to ..." (or "nothing to change" once it
    landed) and never starts a second change."""
    request = afd_pb2.ScaleRequest(
        attention=args.attention,
        ffn=args.ffn,
        expert_parallel_size=args.expert_parallel_size,
        reason=args.reason,
    )
    asked_again = False
    while True:
        try:
            # Asked again, it waits for the connection (up to --timeout) instead of failing at
            # once while the channel backs off from the unanswered attempt.
            reply = stub.Scale(
                request, timeout=args.timeout, metadata=metadata, wait_for_ready=asked_again
            )
            return reply, asked_again
        except grpc.RpcError as exc:
            if not unanswered(exc) or time.monotonic() + args.timeout > deadline:
                raise
            print(
                f"afd-ctl scale: the daemon did not answer ({exc.code().name}); asking again "
                "until --wait-s runs out",
                file=sys.stderr,
            )
            asked_again = True


def run_scale(
    stub: afd_pb2_grpc.AFDInspectStub, args: argparse.Namespace, metadata: Sequence[tuple[str, str]]
) -> int:
    deadline = time.monotonic() + args.wait_s
    reply, asked_again = ask_scale(stub, args, metadata, deadline)
    print(f"{topology_label(reply.current)}: {reply.message}")
    if asked_again and not reply.HasField("target"):
        # The unanswered call may have started the change, which landed before this one:
        # say how it went.
        status = stub.GetStatus(afd_pb2.GetStatusRequest(), timeout=args.timeout, metadata=metadata)
        print(status.last_change)
    if not reply.HasField("target") or args.wait_s <= 0:
        return 0
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
