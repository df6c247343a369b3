"""`afd-ctl serve`: the gRPC server around `Controller`, with health, reflection, TLS, token,
metrics, and an idempotent signal-driven drain."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import signal
import socket
import stat
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from afd_ctl.auth import BearerTokenInterceptor
from afd_ctl.channel import keepalive_options
from afd_ctl.config import DaemonConfig, parse_listen
from afd_ctl.controller import Controller
from afd_ctl.malformed import MalformedRequestInterceptor
from afd_ctl.servicer import ControllerServicer, InspectServicer
from afd_ctl.tls import server_credentials
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.watch_limits import HEALTH_WATCH, TAP, BoundedHealthServicer, WatchLimits

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    afd_pb2.DESCRIPTOR.services_by_name["AFDController"].full_name,
    afd_pb2.DESCRIPTOR.services_by_name["AFDInspect"].full_name,
)
HEALTH_STATUS = {
    "SERVING": health_pb2.HealthCheckResponse.SERVING,
    "NOT_SERVING": health_pb2.HealthCheckResponse.NOT_SERVING,
    "DRAINING": health_pb2.HealthCheckResponse.NOT_SERVING,
}
MAX_MESSAGE_BYTES = 4 << 20
# A health service that is SERVING while the daemon runs and is not draining, whatever the
# membership: for liveness probes (Kubernetes' grpc probe), which must not restart the daemon
# because a worker is missing ("" and the API's services say whether the set is complete).
LIVENESS_SERVICE = "liveness"
TICK_S = 0.1
# A tick this much late is said in the log (loop_stall).
LOOP_STALL_S = 1.0


def remove_stale_socket(path: Path) -> None:
    """A socket left by an earlier daemon is removed; any other file at `path` is an error,
    never deleted."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"cannot listen on unix:{path}: it exists and is not a socket")
    path.unlink()


def loop_stall(slept_s: float) -> str | None:
    """What to say when a TICK_S sleep took `slept_s` (None: nothing, it ran about on time)."""
    late = slept_s - TICK_S
    if late < LOOP_STALL_S:
        return None
    return (
        f"the daemon's event loop was held for {late:.1f} s (a busy or starved host, or "
        "swapping): every call to the daemon waited that long, and calls with a shorter "
        "deadline went unanswered"
    )


class ControllerServer:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.controller = Controller(config)
        # Two budgets: anonymous health Watch streams never take an operator's Tap (issue 39).
        self.watch_limits = WatchLimits(
            config.max_watch_streams, config.max_watch_streams_per_client, HEALTH_WATCH
        )
        self.tap_limits = WatchLimits(
            config.max_tap_streams, config.max_tap_streams_per_client, TAP
        )
        self.health = BoundedHealthServicer(self.watch_limits)
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        # Health changes, applied in order by one task (health.set is a coroutine; a task per
        # change could apply an older state last).
        self._health_updates: asyncio.Queue[str] = asyncio.Queue()
        self._health_task: asyncio.Task[None] | None = None
        self._tick_task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        config = self.config
        # The token check runs first, on handlers whose request parsing is already made safe.
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if config.auth_token:
            interceptors.insert(0, BearerTokenInterceptor(config.auth_token))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                *keepalive_options(config.liveness_timeout_s),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0),
            ],
        )
        afd_pb2_grpc.add_AFDControllerServicer_to_server(
            ControllerServicer(self.controller), server
        )
        afd_pb2_grpc.add_AFDInspectServicer_to_server(
            InspectServicer(self.controller, self.request_stop, self.tap_limits), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                *SERVICE_NAMES,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.address = self._bind(server)
        self.controller.listen_address = self.address
        self._server = server
        metrics_port = 0
        if config.metrics_port:
            from afd_ctl.metrics import serve_metrics

            # Before start(): a metrics port in use ends start-up before anything listens.
            metrics_port = serve_metrics(self.controller, config.metrics_host, config.metrics_port)
        applied = self.controller.health
        await self._set_health(applied)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.controller.health_listeners.append(self._health_updates.put_nowait)
        self._health_task = asyncio.get_running_loop().create_task(self._apply_health(applied))
        self._tick_task = asyncio.get_running_loop().create_task(self._tick(time.monotonic()))
        await server.start()
        log.info(
            "afd-ctl listening on %s (tls=%s, token=%s); expecting %d attention, %d ffn; "
            "NOT_SERVING until they register; routing: %d ffn group(s) (%s)",
            self.address,
            config.tls,
            "on" if config.auth_token else "off",
            config.expect_attention,
            config.expect_ffn,
            config.ffn_groups,
            f"--expert-parallel-size {config.expert_parallel_size}"
            if config.expert_parallel_size
            else "default min(M, N); --expert-parallel-size sets N / E",
        )
        if config.metrics_port:
            log.info("metrics on http://%s:%d/metrics", config.metrics_host, metrics_port)
        return self.address

    def _bind(self, server: grpc.aio.Server) -> str:
        config = self.config
        host, port = parse_listen(config.listen)
        target = config.listen if port is None else f"{host}:{port}"
        # Checked first, so that the reason is one line of ours and not grpcio's log + raise.
        problem = bind_problem(config.listen, host, port)
        if problem:
            raise OSError(problem)
        if port is None:
            remove_stale_socket(Path(host))
        if config.tls:
            credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            add_port = functools.partial(server.add_secure_port, target, credentials)
        else:
            add_port = functools.partial(server.add_insecure_port, target)
        try:
            bound = add_port()
        except RuntimeError:  # grpcio raises "Failed to bind" rather than returning 0
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {config.listen}: address in use or not available")
        if port is None:
            return config.listen
        return f"{host}:{bound}"

    async def _set_health(self, status: str) -> None:
        value = HEALTH_STATUS[status]
        for service in ("", *SERVICE_NAMES):
            await self.health.set(service, value)

    async def _apply_health(self, applied: str) -> None:
        """Applies queued health changes in order; `applied` is the state already set."""
        while True:
            status = await self._health_updates.get()
            if status == applied:
                continue
            if status == "DRAINING":
                # NOT_SERVING for every service, and no later change turns it back.
                await self.health.enter_graceful_shutdown()
                return
            await self._set_health(status)
            applied = status

    async def _tick(self, last: float) -> None:
        """Bounds a planned change's fence (issue 37): the controller has no clock of its own.
        Says when the event loop was held (loop_stall), counted from `last`, the time the task
        was made (a stall before its first turn counts too)."""
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            stall = loop_stall(now - last)
            if stall:
                log.warning("%s", stall)
            last = now
            self.controller.scaling.tick()

    def request_stop(self, reason: str) -> int:
        """`afd-ctl stop`: STOP to every worker, then exit within the drain grace."""
        return self.request_drain(reason, stop=True)

    def request_drain(self, reason: str, *, stop: bool = False) -> int:
        """Idempotent: STOP (with `stop`) or DAEMON_DRAINING to every worker, then exit once
        every session has hung up or the drain grace has passed."""
        told = self.controller.drain(reason, stop=stop)
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return told

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_grace_s
        while self.controller.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.controller.sessions:
            log.warning(
                "drain grace of %.1f s over; closing %d session(s) still open",
                self.config.drain_grace_s,
                len(self.controller.sessions),
            )
        await self.stop(grace=0.5)

    async def stop(self, grace: float) -> None:
        for task in (self._health_task, self._tick_task):
            if task is not None:
                task.cancel()
        if self._server is not None:
            await self._server.stop(grace)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def bind_problem(listen: str, host: str, port: int | None) -> str | None:
    """Why `listen` cannot be bound, in one line that says what to do, or None when a test
    bind works (grpcio only logs and raises "Failed to bind")."""
    if port is None:
        folder = Path(host).parent
        if not folder.is_dir():
            return f"cannot listen on {listen}: folder {folder} does not exist; create it first"
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return (
            f"cannot listen on {listen}: host {host!r} does not resolve ({exc.strerror}); "
            "use an address of this machine, 127.0.0.1 or 0.0.0.0"
        )
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            # As grpcio binds: a port in TIME_WAIT is free, a listening one is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (
                        f"cannot listen on {listen}: port {port} is already in use; stop what "
                        "holds it or pick another port (port 0: any free one)"
                    )
                if exc.errno == errno.EADDRNOTAVAIL:
                    return (
                        f"cannot listen on {listen}: {host} is not an address of this machine; "
                        "use one of its addresses, 127.0.0.1 or 0.0.0.0"
                    )
                return f"cannot listen on {listen}: {exc.strerror}"
    return None


async def serve(config: DaemonConfig) -> None:
    server = ControllerServer(config)
    try:
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_drain, f"{sig.name} received")
        await server.wait_stopped()
    finally:
        # Also when start() failed half-way: a server left to the garbage collector tries to
        # shut down on a closed event loop.
        with contextlib.suppress(Exception):
            await server.stop(grace=0)
    log.info("afd-ctl stopped")
