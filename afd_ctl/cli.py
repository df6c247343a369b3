"""`afd-ctl serve | status | workers | watch | stop | advise | trace`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from afd_ctl import __version__
from afd_ctl.channel import (
    DEFAULT_CONTROLLER,
    ClientTls,
    auth_metadata,
    open_channel,
    tls_problem,
)
from afd_ctl.config import DaemonConfig
from afd_ctl.tls import TlsFileError
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

ROLE_NAMES = {"attention": afd_pb2.ATTENTION, "ffn": afd_pb2.FFN, "all": afd_pb2.ROLE_UNSPECIFIED}
# `afd-ctl status` shows this many of the recent membership events (the JSON has all).
RECENT_SHOWN = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd-ctl",
        description="Control plane for Attention-FFN disaggregated MoE serving.",
    )
    parser.add_argument("--version", action="version", version=f"afd-ctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the afd-ctl daemon. Every flag can also be set as AFD_CTL_<FLAG> "
        "(for example AFD_CTL_EXPECT_FFN=2); flags win.",
    )
    serve.add_argument("--listen", help="HOST:PORT or unix:PATH (default 127.0.0.1:50051)")
    serve.add_argument("--expect-attention", type=int, metavar="M", help="attention workers (1)")
    serve.add_argument("--expect-ffn", type=int, metavar="N", help="FFN workers (1)")
    serve.add_argument(
        "--expert-parallel-size",
        type=int,
        metavar="E",
        help="FFN workers per group, which split the experts; N / E groups, E must divide N "
        "and N / E <= M (N: one group every attention worker reaches; default: min(M, N) groups)",
    )
    serve.add_argument(
        "--liveness-timeout-s",
        type=float,
        metavar="S",
        help="declare a silent worker lost within S seconds (2.0)",
    )
    serve.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        metavar="S",
        help="declare a worker lost whose connection lives but whose heartbeats stopped (60)",
    )
    serve.add_argument(
        "--subscriber-queue", type=int, metavar="K", help="messages queued per worker (4096)"
    )
    serve.add_argument(
        "--max-blob-bytes", type=int, metavar="B", help="data-plane blob limit (1 MiB)"
    )
    serve.add_argument(
        "--max-watch-streams",
        type=int,
        metavar="K",
        help="open health Watch and Tap streams, in total (1024)",
    )
    serve.add_argument(
        "--max-watch-streams-per-client",
        type=int,
        metavar="K",
        help="open health Watch and Tap streams per client host (64)",
    )
    serve.add_argument(
        "--drain-grace-s", type=float, metavar="S", help="SIGTERM/stop grace before exit (5.0)"
    )
    serve.add_argument(
        "--metrics-port", type=int, help="Prometheus text on this port (0: off, -1: any free)"
    )
    serve.add_argument("--metrics-host", help="bind address for metrics (127.0.0.1)")
    serve.add_argument("--tls-cert", metavar="PEM", help="server certificate chain")
    serve.add_argument("--tls-key", metavar="PEM", help="server private key")
    serve.add_argument("--tls-client-ca", metavar="PEM", help="require client certs (mTLS)")
    serve.add_argument("--auth-token", help="require 'authorization: Bearer TOKEN' metadata")
    serve.add_argument("--log-level", help="DEBUG, INFO (default), WARNING")

    def client_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--controller",
            default=os.environ.get("AFD_CTL_CONTROLLER", DEFAULT_CONTROLLER),
            help="daemon address HOST:PORT or unix:PATH (env AFD_CTL_CONTROLLER)",
        )
        p.add_argument(
            "--token",
            default=os.environ.get("AFD_CTL_AUTH_TOKEN", ""),
            help="bearer token (env AFD_CTL_AUTH_TOKEN)",
        )
        p.add_argument(
            "--tls-ca",
            default=os.environ.get("AFD_CTL_TLS_CA", ""),
            metavar="PEM",
            help="CA of the daemon; TLS on (env AFD_CTL_TLS_CA)",
        )
        p.add_argument(
            "--tls-cert",
            default=os.environ.get("AFD_CTL_TLS_CLIENT_CERT", ""),
            metavar="PEM",
            help="client certificate for mTLS; TLS on, with the system CAs unless --tls-ca "
            "(env AFD_CTL_TLS_CLIENT_CERT)",
        )
        p.add_argument(
            "--tls-key",
            default=os.environ.get("AFD_CTL_TLS_CLIENT_KEY", ""),
            metavar="PEM",
            help="client key for mTLS (env AFD_CTL_TLS_CLIENT_KEY)",
        )
        p.add_argument("--timeout", type=float, default=5.0, help="seconds per call (5)")

    status = sub.add_parser(
        "status",
        help="health, epoch, workers per role, steps, lag, recent membership events",
        description="Show the daemon's health, membership epoch, registered and expected "
        "workers per role, steps relayed, each subscriber's queue, and the last "
        f"{RECENT_SHOWN} membership events (--json: every field and every recent event).",
    )
    client_flags(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--require-serving",
        action="store_true",
        help="exit 3 unless the daemon's health is SERVING (a readiness probe over TLS)",
    )
    workers = sub.add_parser(
        "workers",
        help="list registered workers",
        description="List the registered workers: role, role rank, DP and TP rank/size, "
        "worker id, peer address and time since registration.",
    )
    client_flags(workers)
    workers.add_argument("--role", choices=sorted(ROLE_NAMES), default="all")
    workers.add_argument("--json", action="store_true")
    watch = sub.add_parser(
        "watch",
        help="print membership events (and payloads) live",
        description="Print membership events (with --payloads also every payload) as they "
        "happen, one line each, until Ctrl-C or --count.",
    )
    client_flags(watch)
    watch.add_argument("--payloads", action="store_true", help="also print every payload")
    watch.add_argument("--count", type=int, default=0, help="exit after this many events")
    watch.add_argument("--json", action="store_true")
    stop = sub.add_parser(
        "stop",
        help="drain the daemon: STOP to every worker, then exit",
        description="Drain the daemon: health NOT_SERVING, STOP to every worker, exit once "
        "the FFN workers have hung up or the drain grace has passed.",
    )
    client_flags(stop)
    stop.add_argument("--reason", default="", help="recorded in the STOP event")
    advise = sub.add_parser(
        "advise",
        help="bottleneck side and the attention:FFN ratio that balances them",
        description="From the workers' rolling timing windows: which side is the bottleneck, "
        "the attention:FFN ratio that balances them (formula and inputs shown) and the "
        "predicted tokens/s per GPU of a few ratios. Refuses when the window is too short or "
        "too noisy (exit 3).",
    )
    client_flags(advise)
    advise.add_argument("--json", action="store_true")
    trace = sub.add_parser(
        "trace",
        help="record N steps across every worker as a Chrome/Perfetto trace",
        description="Ask every reporting worker to record the next N steps and write them as "
        "trace-event JSON (ui.perfetto.dev, chrome://tracing): one track per worker, clocks "
        "aligned to the daemon's (method and error in the file's metadata).",
    )
    client_flags(trace)
    trace.add_argument("--steps", type=int, default=10, help="consecutive steps (10)")
    trace.add_argument("--out", required=True, help="file to write")
    trace.add_argument("--wait-s", type=float, default=30.0, help="wait for the workers (30)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        return run_client_command(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return stdout_closed()


def stdout_closed() -> int:
    """`afd-ctl status | head`: the reader went away. Quietly, like other Unix tools: point
    stdout at /dev/null so the interpreter's final flush does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe


def run_serve(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        config = DaemonConfig.resolve(flags)
    except ValueError as exc:
        print(f"afd-ctl serve: {exc}", file=sys.stderr)
        return 2
    level = config.log_level.upper()
    if not isinstance(logging.getLevelName(level), int):
        print(
            f"afd-ctl serve: --log-level {config.log_level!r} is not a level; "
            "use DEBUG, INFO, WARNING or ERROR",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger(__name__).info("config: %s", config.describe())
    from afd_ctl.server import serve

    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"afd-ctl serve: {exc}", file=sys.stderr)
        return 1
    return 0


def run_client_command(args: argparse.Namespace) -> int:
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        # Without --tls-ca the system's CAs check the daemon; a client pair is for mTLS.
        tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    try:
        channel = open_channel(args.controller, tls)
    except TlsFileError as exc:  # a missing, unreadable or malformed file, or half a pair
        print(f"afd-ctl {args.command}: {exc}", file=sys.stderr)
        return 2
    stub = afd_pb2_grpc.AFDInspectStub(channel)
    metadata = auth_metadata(args.token)
    try:
        if args.command == "status":
            status = stub.GetStatus(
                afd_pb2.GetStatusRequest(), timeout=args.timeout, metadata=metadata
            )
            print(to_json(status) if args.json else format_status(status))
            if args.require_serving and health_of(status) != "SERVING":
                print(
                    f"afd-ctl status: health is {health_of(status)}, not SERVING "
                    "(--require-serving)",
                    file=sys.stderr,
                )
                return 3
        elif args.command == "workers":
            reply = stub.ListWorkers(
                afd_pb2.ListWorkersRequest(role=ROLE_NAMES[args.role]),
                timeout=args.timeout,
                metadata=metadata,
            )
            print(to_json(reply) if args.json else format_workers(reply.workers))
        elif args.command == "watch":
            what = "membership events and payloads" if args.payloads else "membership events"
            until = f"{args.count} events" if args.count else "Ctrl-C"
            # stderr: stdout stays one event per line (and pure JSON with --json).
            print(f"watching {what} at {args.controller} until {until}", file=sys.stderr)
            seen = 0
            for event in stub.Tap(
                afd_pb2.TapRequest(include_payloads=args.payloads), metadata=metadata
            ):
                print(to_json(event, indent=None) if args.json else format_tap(event), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
        elif args.command == "advise":
            return run_advise(stub, args, metadata)
        elif args.command == "trace":
            return run_trace(stub, args, metadata)
        elif args.command == "stop":
            reply = stub.Stop(
                afd_pb2.StopRequest(reason=args.reason), timeout=args.timeout, metadata=metadata
            )
            print(f"draining: STOP sent to {reply.ffn_workers_told} FFN worker(s)")
    except grpc.RpcError as exc:
        code = exc.code()
        hint = ""
        problem = None
        if code == grpc.StatusCode.UNAVAILABLE:
            problem = tls_problem(exc.details() or "", args.controller, tls)
            hint = f"; is `afd-ctl serve` running at {args.controller}?"
        if problem is not None:
            print(f"afd-ctl {args.command}: {problem[0]}", file=sys.stderr)
            return 1
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            hint = "; pass --token or set AFD_CTL_AUTH_TOKEN"
        print(f"afd-ctl {args.command}: {code.name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    return 0


def run_advise(
    stub: afd_pb2_grpc.AFDInspectStub,
    args: argparse.Namespace,
    metadata: tuple[tuple[str, str], ...],
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


def run_trace(
    stub: afd_pb2_grpc.AFDInspectStub,
    args: argparse.Namespace,
    metadata: tuple[tuple[str, str], ...],
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
    return 0


def to_json(message: Message, indent: int | None = 2) -> str:
    """Every field, zeros and empty lists included, with 64-bit numbers as JSON numbers."""
    data = json_format.MessageToDict(
        message,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
        unquote_int64_if_possible=True,
    )
    return json.dumps(data, indent=indent, sort_keys=True)


def health_of(status: afd_pb2.Status) -> str:
    # health_state is the enum; an older daemon only fills the word.
    return afd_pb2.Health.Name(status.health_state) if status.health_state else status.health


def format_status(status: afd_pb2.Status) -> str:
    health = health_of(status)
    lines = [
        f"health      {health}",
        f"epoch       {status.epoch}   (incarnation {status.controller_incarnation})",
        f"listen      {status.listen}   uptime {status.uptime_s:.0f} s",
        f"steps       {status.steps_relayed} relayed, last step id {status.last_step_id}, "
        f"{status.payloads_rejected} rejected",
        "",
        f"{'ROLE':<10} {'REGISTERED':>10} {'EXPECTED':>9}",
    ]
    for role in status.roles:
        lines.append(
            f"{afd_pb2.Role.Name(role.role).lower():<10} {role.registered:>10} {role.expected:>9}"
        )
    if status.ffn_groups:  # an older daemon does not say
        expected = {r.role: r.expected for r in status.roles}
        ffn = expected.get(afd_pb2.FFN, 0)
        lines.append(
            f"ffn groups  {status.ffn_groups} (expert-parallel size "
            f"{ffn // status.ffn_groups if ffn % status.ffn_groups == 0 else 'uneven'})"
        )
    if status.subscribers:
        lines += ["", f"{'SUBSCRIBER':<28} {'QUEUED':>7} {'CAPACITY':>9} {'LAST STEP':>10}"]
        for sub in status.subscribers:
            lines.append(
                f"{sub.worker_id:<28} {sub.queued:>7} {sub.queue_capacity:>9} {sub.last_step_id:>10}"
            )
    if status.loads:
        lines += [
            "",
            f"{'LOAD (ROLLING WINDOW)':<28} {'ROLE':<9} {'STEPS':>6} {'UTIL':>5} {'WAIT':>5} "
            f"{'COMPUTE MS':>10} {'WAIT MS':>8} {'TOKENS':>7}",
        ]
        for load in status.loads:
            lines.append(
                f"{load.worker_id:<28} {afd_pb2.Role.Name(load.role).lower():<9} "
                f"{load.steps:>6} {load.utilisation:>5.0%} {load.waiting_share:>5.0%} "
                f"{load.compute_ms_per_step:>10.3f} {load.wait_ms_per_step:>8.3f} "
                f"{load.tokens_per_step:>7.1f}"
            )
    if status.taps:
        lines += [
            "",
            f"{'TAP (LIVE STREAM)':<28} {'QUEUED':>7} {'CAPACITY':>9} {'SENT':>8} "
            f"{'LAST STEP':>10} {'BEHIND':>7}",
        ]
        for tap in status.taps:
            behind = status.last_step_id - tap.last_step_id if tap.include_payloads else 0
            lines.append(
                f"{tap.peer:<28} {tap.queued:>7} {tap.queue_capacity:>9} {tap.delivered:>8} "
                f"{tap.last_step_id if tap.include_payloads else '-':>10} {behind:>7}"
            )
    if status.recent_events:
        lines += ["", "RECENT EVENTS"]
        for event in status.recent_events[-RECENT_SHOWN:]:
            kind = afd_pb2.MembershipEvent.Kind.Name(event.kind)
            who = ""
            if event.HasField("worker"):
                role_name = afd_pb2.Role.Name(event.worker.role).lower()
                who = f" {role_name} {event.worker.role_rank} ({event.worker.worker_id})"
            when = time.strftime("%H:%M:%S", time.localtime(event.at_s))
            reason = f": {event.reason}" if event.reason else ""
            lines.append(f"{when} {kind}{who}{reason}")
    return "\n".join(lines)


def format_workers(workers: Sequence[afd_pb2.WorkerInfo]) -> str:
    if not workers:
        return "no workers registered"
    lines = [f"{'ROLE':<10} {'RANK':>4} {'DP':>5} {'TP':>5}  {'WORKER ID':<28} {'PEER':<24} AGE"]
    now = time.time()
    for w in workers:
        dp, tp = f"{w.dp_rank}/{w.dp_size}", f"{w.tp_rank}/{w.tp_size}"
        lines.append(
            f"{afd_pb2.Role.Name(w.role).lower():<10} {w.role_rank:>4} {dp:>5} {tp:>5}  "
            f"{w.worker_id:<28} {w.peer:<24} {now - w.registered_at_s:.0f}s"
        )
    return "\n".join(lines)


def format_tap(event: afd_pb2.TapEvent) -> str:
    if event.WhichOneof("event") == "payload":
        p = event.payload
        stages = " ".join(
            f"s{i}={list(p.stages[i].num_tokens_across_dp)}" for i in sorted(p.stages)
        )
        flags = [
            name
            for name in (
                "is_warmup",
                "is_graph_capturing",
                "is_graph_replaying",
                "records_only",
                "is_profile",
                "stop",
            )
            if getattr(p, name)
        ]
        return f"payload step={p.step_id} epoch={p.epoch} from={p.sender_role_rank} {stages} {' '.join(flags)}".rstrip()
    e = event.membership
    who = ""
    if e.HasField("worker"):
        who = f" {afd_pb2.Role.Name(e.worker.role).lower()} rank {e.worker.role_rank} ({e.worker.worker_id})"
    kind = afd_pb2.MembershipEvent.Kind.Name(e.kind)
    return f"event {kind}{who} epoch={e.view.epoch} complete={e.view.complete} {e.reason}".rstrip()


if __name__ == "__main__":
    sys.exit(main())
