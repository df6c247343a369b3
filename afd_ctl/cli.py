"""`afd-ctl serve | status | workers | watch | stop | advise | trace | scale`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import grpc

from afd_ctl import __version__
from afd_ctl.channel import (
    DEFAULT_CONTROLLER,
    ClientTls,
    auth_metadata,
    open_channel,
    tls_problem,
)
from afd_ctl.cli_scale import add_scale_parser, run_scale
from afd_ctl.cli_text import (
    RECENT_SHOWN,
    format_status,
    format_workers,
    health_of,
    run_watch,
    to_json,
)
from afd_ctl.cli_timing import out_path_problem, run_advise, run_trace
from afd_ctl.config import DaemonConfig
from afd_ctl.tls import TlsFileError
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

ROLE_NAMES = {"attention": afd_pb2.ATTENTION, "ffn": afd_pb2.FFN, "all": afd_pb2.ROLE_UNSPECIFIED}


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
    for kind, what, total, per_client in (
        ("watch", "health Watch streams (no token needed)", 1024, 64),
        ("tap", "Tap streams (afd-ctl watch), a budget of their own", 64, 16),
    ):
        serve.add_argument(
            f"--max-{kind}-streams", type=int, metavar="K", help=f"open {what}, in total ({total})"
        )
        serve.add_argument(
            f"--max-{kind}-streams-per-client",
            type=int,
            metavar="K",
            help=f"open {what}, per client host ({per_client})",
        )
    serve.add_argument(
        "--drain-grace-s", type=float, metavar="S", help="SIGTERM/stop grace before exit (5.0)"
    )
    serve.add_argument(
        "--fence-timeout-s",
        type=float,
        metavar="S",
        help="give a scale up when attention workers do not hold at its fence within S (10)",
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
        p.add_argument(
            "--timeout", type=float, default=5.0, help="seconds per call; watch: to connect (5)"
        )

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
        "predicted tokens/s per GPU of a few ratios, from medians of serving steps, with the "
        "ratio's interval (a noisy or short window is answered and says so). Refuses only "
        "without data: a side that does not report or has no serving step yet, no tokens or "
        "no compute time (exit 3).",
    )
    client_flags(advise)
    advise.add_argument("--json", action="store_true")
    trace = sub.add_parser(
        "trace",
        help="record N steps across every worker as a Chrome/Perfetto trace",
        description="Ask every reporting worker to record the next N steps and write them as "
        "trace-event JSON (ui.perfetto.dev, chrome://tracing): one track per worker, clocks "
        "aligned to the daemon's (method and error in the file's metadata). Fails in one line "
        "before recording when --out cannot be written, and after 5 s when no step runs.",
    )
    client_flags(trace)
    trace.add_argument("--steps", type=int, default=10, help="consecutive steps (10)")
    trace.add_argument("--out", required=True, help="file to write")
    trace.add_argument(
        "--wait-s", type=float, default=30.0, help="wait for the workers' spans (30)"
    )
    client_flags(add_scale_parser(sub))
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
    if args.command == "trace":  # before recording: a trace nobody can keep is lost work
        unwritable = out_path_problem(args.out)
        if unwritable:
            print(f"afd-ctl trace: {unwritable}", file=sys.stderr)
            return 2
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
            return run_watch(stub, channel, args, metadata)
        elif args.command == "advise":
            return run_advise(stub, args, metadata)
        elif args.command == "trace":
            return run_trace(stub, args, metadata)
        elif args.command == "scale":
            return run_scale(stub, args, metadata)
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


if __name__ == "__main__":
    sys.exit(main())
