"""A simulated attention or FFN worker: real registration and per-step payloads, no model.

Used by `make demo-sim`, the tests and the control-hop benchmark, and handy for smoke-testing a
daemon (`python -m afd_ctl.sim_worker --role ffn --controller HOST:PORT`). Payload contents are
a function of the step id, so the FFN side verifies every payload it receives: nothing lost,
duplicated, reordered or altered. The last stdout line is a JSON report.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from afd_ctl import payloads
from afd_ctl.channel import DEFAULT_CONTROLLER
from afd_ctl.client import ControllerClient
from afd_ctl.errors import (
    AfdControllerUnreachable,
    AfdError,
    AfdPeerLost,
    AfdStopped,
    AfdTimeout,
)
from afd_ctl.membership import WorkerSpec
from afd_ctl.routing import Role
from afd_ctl.v1 import afd_pb2


def expected_counts(step_id: int, stage: int, dp_size: int) -> list[int]:
    return [(step_id * 7 + rank * 13 + stage * 31) % 97 for rank in range(dp_size)]


def make_payload(step_id: int, dp_size: int, stages: int) -> afd_pb2.AFDControlPayload:
    counts = [expected_counts(step_id, stage, dp_size) for stage in range(stages)]
    return payloads.make_payload(step_id, counts, is_warmup=step_id <= 2)


def run_attention(client: ControllerClient, args: argparse.Namespace) -> dict[str, object]:
    view = client.wait_complete(args.timeout)
    report: dict[str, object] = {
        "role": "attention",
        "role_rank": client.role_rank,
        "is_sender": client.is_sender,
        "epoch": view.epoch,
        "peers": [peer.worker.role_rank for peer in view.peers],
        "published": 0,
    }
    if not client.is_sender:
        return report
    period = 1.0 / args.rate if args.rate > 0 else 0.0
    start = time.monotonic()
    for i in range(args.steps):
        step_id = args.first_step + i
        client.publish(make_payload(step_id, args.attention_dp_size, args.stages))
        report["published"] = i + 1
        if period:
            delay = start + (i + 1) * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    if args.send_stop:
        client.publish(afd_pb2.AFDControlPayload(step_id=args.first_step + args.steps, stop=True))
    client.flush(args.timeout)
    return report


def run_ffn(client: ControllerClient, args: argparse.Namespace) -> dict[str, object]:
    view = client.wait_complete(args.timeout)
    received = 0
    last: int | None = None
    problems: list[str] = []
    stopped = ""
    first: int | None = None
    unreachable_since: float | None = None
    while args.steps <= 0 or received < args.steps:
        try:
            payload = client.next_payload(args.timeout)
        except AfdControllerUnreachable as exc:
            # A daemon restart (or drain): the client registers again by itself.
            now = time.monotonic()
            unreachable_since = unreachable_since or now
            if now - unreachable_since > args.timeout:
                problems.append(str(exc))
                break
            time.sleep(0.05)
            continue
        except AfdStopped as exc:
            stopped = str(exc)
            break
        except AfdPeerLost as exc:
            problems.append(str(exc))
            break
        except AfdTimeout as exc:
            problems.append(str(exc))
            break
        unreachable_since = None
        if first is None:
            first = payload.step_id
        if last is not None and payload.step_id != last + 1:
            problems.append(f"step {payload.step_id} after {last}")
        for stage in range(args.stages):
            got = list(payload.stages[stage].num_tokens_across_dp)
            if got != expected_counts(payload.step_id, stage, args.attention_dp_size):
                problems.append(f"step {payload.step_id} stage {stage} counts {got}")
        last = payload.step_id
        received += 1
    if args.wait_stop and not stopped:
        try:
            client.next_payload(args.timeout)
        except AfdStopped as exc:
            stopped = str(exc)
        except AfdError as exc:
            problems.append(f"waiting for stop: {exc}")
    return {
        "role": "ffn",
        "role_rank": client.role_rank,
        "epoch": view.epoch,
        "peers": [peer.worker.role_rank for peer in view.peers],
        "received": received,
        "first_step": first,
        "last_step": last,
        "problems": problems[:20],
        "stopped": stopped,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--controller", default=DEFAULT_CONTROLLER)
    parser.add_argument("--role", choices=[r.label for r in Role], required=True)
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument(
        "--attention-dp-size", type=int, default=1, help="entries in num_tokens_across_dp"
    )
    parser.add_argument("--steps", type=int, default=300, help="steps to publish / expect")
    parser.add_argument("--first-step", type=int, default=1)
    parser.add_argument("--rate", type=float, default=0.0, help="steps per second (0: flat out)")
    parser.add_argument("--stages", type=int, default=1, choices=[1, 2])
    parser.add_argument("--send-stop", action="store_true", help="attention: publish stop last")
    parser.add_argument("--wait-stop", action="store_true", help="ffn: wait for stop at the end")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--hold-s", type=float, default=0.0, help="stay registered this long after the report"
    )
    parser.add_argument("--token", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    role = Role.parse(args.role)
    worker_id = args.worker_id or f"sim-{args.role}-{args.dp_rank}"
    spec = WorkerSpec(worker_id, role, dp_rank=args.dp_rank, dp_size=args.dp_size)
    client = ControllerClient(args.controller, spec, token=args.token)
    try:
        client.connect(args.timeout)
        report = run_attention(client, args) if role is Role.ATTENTION else run_ffn(client, args)
    except AfdError as exc:
        print(json.dumps({"role": args.role, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    else:
        # Report first, then stay registered so the others' epoch does not change under them.
        print(json.dumps(report), flush=True)
        client.wait_drained(args.hold_s)
    finally:
        client.close()
    return 0 if not report.get("problems") else 1


if __name__ == "__main__":
    sys.exit(main())
