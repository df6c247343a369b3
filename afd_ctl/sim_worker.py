"""A simulated attention or FFN worker: real registration and per-step payloads, no model.

Used by `make demo-sim`, the tests and the control-hop benchmark, and handy for smoke-testing a
daemon (`python -m afd_ctl.sim_worker --role ffn --controller HOST:PORT`). Payload contents are
a function of the step id, so the FFN side verifies every payload it receives: nothing lost,
duplicated, reordered or altered. The last stdout line is a JSON report.

With --model-* flags it also reports per-step timings (issue 26) from a known model: per
layer, attention takes --model-attention-ms and the FFN c0 + c1 * tokens; each side waits for
the other's excess. With --model-sleep it sleeps each modelled step, so its trace spans (when
`afd-ctl trace` asks) lie on the real clock.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time

from afd_ctl.channel import DEFAULT_CONTROLLER
from afd_ctl.client import ControllerClient
from afd_ctl.errors import (
    AfdControllerUnreachable,
    AfdError,
    AfdNotReady,
    AfdPeerLost,
    AfdStaleEpoch,
    AfdStopped,
    AfdTimeout,
)
from afd_ctl.membership import WorkerSpec
from afd_ctl.routing import Role
from afd_ctl.step import Step, StepFlags
from afd_ctl.v1 import afd_pb2


def expected_counts(step_id: int, stage: int, dp_size: int) -> list[int]:
    return [(step_id * 7 + rank * 13 + stage * 31) % 97 for rank in range(dp_size)]


def is_warmup_step(step_id: int) -> bool:
    return step_id <= 2  # published as warm-up, and reported as such (as vLLM workers do)


def make_payload(step_id: int, dp_size: int, stages: int) -> afd_pb2.AFDControlPayload:
    counts = [expected_counts(step_id, stage, dp_size) for stage in range(stages)]
    return Step.of(step_id, counts, flags=StepFlags(is_warmup=is_warmup_step(step_id))).to_payload()


def modelled(args: argparse.Namespace) -> bool:
    return bool(args.model_attention_ms or args.model_ffn_c0_ms or args.model_ffn_c1_us)


def model_step(
    client: ControllerClient, args: argparse.Namespace, step_id: int, tokens: int, ffn_tokens: int
) -> None:
    """Reports (and with --model-sleep, spends) one step of the timing model."""
    jitter = 1 + args.model_jitter * (2 * random.random() - 1) if args.model_jitter else 1.0
    t_a = args.model_attention_ms / 1e3 * (jitter if args.role == "attention" else 1.0)
    t_f = (args.model_ffn_c0_ms / 1e3 + args.model_ffn_c1_us / 1e6 * ffn_tokens) * (
        jitter if args.role == "ffn" else 1.0
    )
    layers = args.model_layers
    own, other = (t_a, t_f) if args.role == "attention" else (t_f, t_a)
    wait = max(0.0, other - own)
    reporter = client.timings
    start = time.monotonic()
    if reporter.tracing(step_id):
        names = ("attention", "wait") if args.role == "attention" else ("ffn_compute", "return")
        reporter.span("step", step_id, start, start + layers * (own + wait))
        for layer in range(layers):
            t = start + layer * (own + wait)
            if args.role == "attention":
                reporter.span(names[0], step_id, t, t + own, layer)
                reporter.span("send", step_id, t + own, t + own, layer)
                reporter.span(names[1], step_id, t + own, t + own + wait, layer)
            else:
                reporter.span("recv_wait", step_id, t, t + wait, layer)
                reporter.span(names[0], step_id, t + wait, t + wait + own, layer)
                reporter.span(names[1], step_id, t + wait + own, t + wait + own, layer)
    if args.model_sleep:
        time.sleep(layers * (own + wait))
    reporter.step(
        step_id,
        compute_s=layers * own,
        wait_s=layers * wait,
        tokens=tokens if args.role == "attention" else ffn_tokens,
        warmup=is_warmup_step(step_id),
    )


def step_tokens(step_id: int, args: argparse.Namespace, dp_size: int) -> tuple[int, int]:
    """(this attention rank's tokens, all ranks' tokens) of a step, over its stages."""
    counts = [expected_counts(step_id, s, dp_size) for s in range(args.stages)]
    return sum(c[args.dp_rank % len(c)] for c in counts), sum(sum(c) for c in counts)


def dp_size_of(args: argparse.Namespace, view: afd_pb2.View) -> int:
    """Entries in num_tokens_across_dp: --attention-dp-size, or (0) the view's attention ranks,
    which a planned change (afd-ctl scale) can change."""
    return args.attention_dp_size or view.expected_attention


def run_attention(client: ControllerClient, args: argparse.Namespace) -> dict[str, object]:
    view = client.wait_complete(args.timeout)
    epochs = [view.epoch]
    report: dict[str, object] = {
        "role": "attention",
        "role_rank": client.role_rank,
        "is_sender": client.is_sender,
        "epoch": view.epoch,
        "peers": [peer.worker.role_rank for peer in view.peers],
        "published": 0,
        "epochs": epochs,
    }
    if not client.is_sender and args.steps > 0:
        return report
    period = 1.0 / args.rate if args.rate > 0 else 0.0
    start = time.monotonic()
    published, step_id = 0, args.first_step - 1
    drained = False
    while args.steps <= 0 or published < args.steps:
        # Issue 37: a planned change. Hold at its fence, drain when leaving; retired: done.
        try:
            moved = client.hold(step_id if published else 0, args.timeout)
        except AfdStopped as exc:
            report["stopped"] = str(exc)
            break
        if moved is not None:
            epochs.append(moved.epoch)
            continue
        view = client.view
        # Until stopped, a worker with nothing to publish waits (a fixed --steps run publishes
        # and fails as before: AfdPeerLost when the set is incomplete).
        idle = args.steps <= 0 and not (client.is_sender and view.complete)
        if view.leaving or idle:
            if view.leaving and not drained:
                client.drained("sim: nothing in flight")
                drained = True
            if client.wait_stopped(0.02):
                report["stopped"] = "retired" if drained else "stopped"
                break
            continue
        try:
            client.publish(make_payload(step_id + 1, dp_size_of(args, view), args.stages))
        except (AfdControllerUnreachable, AfdNotReady, AfdPeerLost, AfdStaleEpoch) as exc:
            if args.steps > 0:
                raise
            # Run until stopped: the daemon went away, or a loss moved the epoch under a step
            # in flight (afd-ctl stop: the FFN side hangs up first). A step lost so mid-run
            # shows as a gap on the FFN side's report.
            report["ended"] = str(exc)
            break
        step_id += 1
        published += 1
        report["published"], report["last_step"] = published, step_id
        if modelled(args):
            model_step(client, args, step_id, *step_tokens(step_id, args, dp_size_of(args, view)))
        if period:
            delay = start + published * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    if args.send_stop:
        client.publish(afd_pb2.AFDControlPayload(step_id=args.first_step + args.steps, stop=True))
    if published and "ended" not in report and "stopped" not in report:
        client.flush(args.timeout)
    return report


def run_ffn(client: ControllerClient, args: argparse.Namespace) -> dict[str, object]:
    view = client.wait_complete(args.timeout)
    received = 0
    last: int | None = None
    problems: list[str] = []
    stopped = ""
    first: int | None = None
    last_by_sender: dict[int, int] = {}
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
        # Each sender's steps, in order and none missing (across planned changes too).
        before = last_by_sender.get(payload.sender_role_rank)
        if before is not None and payload.step_id != before + 1:
            problems.append(
                f"step {payload.step_id} after {before} from sender {payload.sender_role_rank}"
            )
        last_by_sender[payload.sender_role_rank] = payload.step_id
        dp_size = args.attention_dp_size or len(payload.stages[0].num_tokens_across_dp)
        for stage in range(args.stages):
            got = list(payload.stages[stage].num_tokens_across_dp)
            if got != expected_counts(payload.step_id, stage, dp_size):
                problems.append(f"step {payload.step_id} stage {stage} counts {got}")
        last = payload.step_id
        received += 1
        if modelled(args):
            mine, everyone = step_tokens(payload.step_id, args, dp_size)
            model_step(client, args, payload.step_id, mine, everyone)
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
        "last_by_sender": last_by_sender,
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
        "--attention-dp-size",
        type=int,
        default=1,
        help="entries in num_tokens_across_dp (0: the current view's attention ranks, which "
        "afd-ctl scale changes)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="steps to publish / expect (0: until stopped or retired; attention workers then "
        "follow planned changes: hold at a fence, drain when leaving)",
    )
    parser.add_argument("--max-attention", type=int, default=0, help="data-plane capacity (0: any)")
    parser.add_argument("--max-ffn", type=int, default=0, help="data-plane capacity (0: any)")
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
    model = parser.add_argument_group("timing model (issue 26; off unless set)")
    model.add_argument("--model-attention-ms", type=float, default=0.0, help="T_a per layer")
    model.add_argument("--model-ffn-c0-ms", type=float, default=0.0, help="T_f fixed per layer")
    model.add_argument("--model-ffn-c1-us", type=float, default=0.0, help="T_f per token per layer")
    model.add_argument("--model-layers", type=int, default=4)
    model.add_argument("--model-jitter", type=float, default=0.0, help="relative, uniform")
    model.add_argument("--model-sleep", action="store_true", help="spend each modelled step")
    model.add_argument("--timings-interval-s", type=float, default=1.0)
    model.add_argument(
        "--timings-no-final-flush",
        action="store_true",
        help="leave the last steps' report to the reporter's idle timer (what a serving worker "
        "that goes idle relies on) instead of sending it before the JSON report",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    role = Role.parse(args.role)
    worker_id = args.worker_id or f"sim-{args.role}-{args.dp_rank}"
    spec = WorkerSpec(
        worker_id,
        role,
        dp_rank=args.dp_rank,
        dp_size=args.dp_size,
        max_attention=args.max_attention,
        max_ffn=args.max_ffn,
        follows_scale=True,  # run_attention/run_ffn follow planned changes
    )
    client = ControllerClient(args.controller, spec, token=args.token)
    client.timings.layers = args.model_layers
    client.timings.interval_s = args.timings_interval_s
    try:
        client.connect(args.timeout)
        report = run_attention(client, args) if role is Role.ATTENTION else run_ffn(client, args)
        if modelled(args):
            if not args.timings_no_final_flush:
                client.timings.flush()
            report["timing_reports"] = client.timings.sent
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
