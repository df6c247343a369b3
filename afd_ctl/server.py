"""`afd-ctl serve`: the gRPC server around `Controller`, with health, reflection, TLS, token,
metrics, and an idempotent signal-driven drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import stat
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from afd_ctl.auth import BearerTokenInterceptor
from afd_ctl.channel import keepalive_options
from afd_ctl.config import DaemonConfig, parse_listen
from afd_ctl.controller import Controller
from afd_ctl.malformed import MalformedRequestInterceptor
from afd_ctl.membership import FFN
from afd_ctl.servicer import ControllerServicer, InspectServicer
from afd_ctl.tls import server_credentials
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

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


class ControllerServer:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.controller = Controller(config)
        self.health = health.aio.HealthServicer()
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        # Health changes, applied in order by one task (health.set is a coroutine; a task per
        # change could apply an older state last).
        self._health_updates: asyncio.Queue[str] = asyncio.Queue()
        self._health_task: asyncio.Task[None] | None = None

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
            InspectServicer(self.controller, self.request_drain), server
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
        applied = self.controller.health
        await self._set_health(applied)
        self.controller.health_listeners.append(self._health_updates.put_nowait)
        self._health_task = asyncio.get_running_loop().create_task(self._apply_health(applied))
        await server.start()
        log.info(
            "afd-ctl listening on %s (tls=%s, token=%s); expecting %d attention, %d ffn; "
            "NOT_SERVING until they register",
            self.address,
            config.tls,
            "on" if config.auth_token else "off",
            config.expect_attention,
            config.expect_ffn,
        )
        if config.metrics_port:
            from afd_ctl.metrics import serve_metrics

            port = serve_metrics(self.controller, config.metrics_host, config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", config.metrics_host, port)
        return self.address

    def _bind(self, server: grpc.aio.Server) -> str:
        config = self.config
        host, port = parse_listen(config.listen)
        target = config.listen if port is None else f"{host}:{port}"
        if port is None:
            remove_stale_socket(Path(host))
        if config.tls:
            credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            bound = server.add_secure_port(target, credentials)
        else:
            bound = server.add_insecure_port(target)
        if port is None:
            return config.listen
        if bound == 0:
            raise OSError(f"cannot listen on {config.listen}: address in use or not available")
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

    def request_drain(self, reason: str) -> int:
        """Idempotent: STOP to every worker, then exit within the drain grace."""
        told = self.controller.drain(reason)
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return told

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_grace_s
        while self._ffn_sessions() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._ffn_sessions():
            log.warning(
                "drain grace of %.1f s over; closing %d FFN session(s) still open",
                self.config.drain_grace_s,
                self._ffn_sessions(),
            )
        await self.stop(grace=0.5)

    def _ffn_sessions(self) -> int:
        return sum(1 for s in self.controller.sessions.values() if s.worker.role == FFN)

    async def stop(self, grace: float) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._server is not None:
            await self._server.stop(grace)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(config: DaemonConfig) -> None:
    server = ControllerServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(
            sig, lambda s=sig: server.request_drain(f"{signal.Signals(s).name} received")
        )
    try:
        await server.wait_stopped()
    finally:
        with contextlib.suppress(Exception):
            await server.stop(grace=0)
    log.info("afd-ctl stopped")
