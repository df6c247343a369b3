"""gRPC servicers: translate between the wire and `Controller`, nothing more.

Domain errors (ControlError) become statuses here and only here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from afd_ctl import publish_stream
from afd_ctl.aio_calls import abort, send, status_code
from afd_ctl.controller import Controller
from afd_ctl.daemon_views import scale_reply
from afd_ctl.errors import ControlError
from afd_ctl.fingerprint import from_proto
from afd_ctl.logs import RateLimitedLog, clip
from afd_ctl.mailbox import MailboxClosed
from afd_ctl.malformed import MalformedRequest
from afd_ctl.membership import WorkerSpec
from afd_ctl.trace import DEFAULT_TRACE_TIMEOUT_S, TRACE_IDLE_S, PendingTrace
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc
from afd_ctl.watch_limits import TAP, WatchLimits, refuse
from afd_ctl.wire import PROTO_TO_ROLE

log = logging.getLogger(__name__)

SESSION_CLOSED = (
    "session closed: the worker exited, was killed or hung up, or stopped answering keepalive "
    "pings (frozen, or the network is down)"
)
HEARTBEAT = afd_pb2.SessionMessage(heartbeat=afd_pb2.Heartbeat())
# Registrations refused when they open, rate-limited: anyone who can reach the port can
# send them as fast as they like.
REGISTRATION_REFUSED = RateLimitedLog(log, "registration refused")
SCALE_REFUSED = RateLimitedLog(log, "scale refused")
TRACE_POLL_S = 0.05
# Session messages besides register, heartbeat and leave: timings and spans (issue 26), a
# leaving worker's `drained` and an attention worker's `fenced` (issue 37).
OPTIONAL = ("timings", "trace", "drained", "fenced")


def role_name(value: int) -> str:
    """ATTENTION, FFN, or what validation refuses: another name or, for a number the enum does
    not define (proto3 enums are open), the number."""
    if value in PROTO_TO_ROLE:
        return PROTO_TO_ROLE[value]
    return afd_pb2.Role.Name(value) if value in afd_pb2.Role.values() else str(value)


class Heard:
    """When a worker's session last said anything, why it left, if it said so, and what did
    not parse, if something did."""

    def __init__(self, on_optional: Callable[[afd_pb2.SessionRequest], None] | None = None) -> None:
        self.at = time.monotonic()
        self.left = ""
        self.malformed = ""
        # Timing reports and trace spans (issue 26) go here.
        self.on_optional = on_optional

    async def follow(self, requests: AsyncIterator[afd_pb2.SessionRequest]) -> None:
        try:
            async for request in requests:
                self.at = time.monotonic()
                which = request.WhichOneof("message")
                if which == "leave":
                    # Kept as logs quote client text (it travels in every PEER_LOST event).
                    self.left = clip(request.leave.reason) or "no reason given"
                elif which in OPTIONAL and self.on_optional is not None:
                    self.on_optional(request)
        except MalformedRequest as error:
            self.malformed = error.message


class ControllerServicer(afd_pb2_grpc.AFDControllerServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def Session(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[afd_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        liveness_s = self.controller.config.liveness_timeout_s
        heartbeat_s = self.controller.config.heartbeat_timeout_s
        requests = aiter(request_iterator)
        try:
            first = await asyncio.wait_for(anext(requests), liveness_s)
        except (TimeoutError, StopAsyncIteration):
            first = None
        if first is None or first.WhichOneof("message") != "register":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the first Session message must be `register`, within {liveness_s} s",
            )
            return
        request = first.register
        spec = WorkerSpec(
            worker_id=request.worker_id,
            role=role_name(request.role),
            dp_rank=request.dp_rank,
            dp_size=request.dp_size,
            tp_rank=request.tp_rank,
            tp_size=request.tp_size,
            data_plane_blob=request.data_plane_blob,
            model=from_proto(request.model) if request.HasField("model") else None,
            max_attention=request.max_attention,
            max_ffn=request.max_ffn,
            follows_scale=request.follows_scale,
            lockstep_size=request.lockstep_size,
            step_socket=request.step_socket,
        )
        try:
            session = self.controller.open_session(spec, context.peer())
        except ControlError as error:
            REGISTRATION_REFUSED.warn(
                f"{clip(request.worker_id)!r} from {context.peer()}: {error.message}"
            )
            await abort(context, error)
            return
        controller = self.controller

        def on_optional(request: afd_pb2.SessionRequest) -> None:
            which = request.WhichOneof("message")
            if which == "timings":
                controller.record_timings(session, request.timings)
            elif which == "trace":
                controller.record_trace(session, request.trace, time.monotonic())
            else:
                controller.acknowledge(session, request)

        heard = Heard(on_optional)
        reader = asyncio.get_running_loop().create_task(heard.follow(requests))
        beat_s = liveness_s / 4
        reason = SESSION_CLOSED
        try:
            while True:
                try:
                    message = await session.mailbox.get(beat_s)
                except MailboxClosed as closed:
                    if closed.code not in ("OK", "CANCELLED"):
                        reason = closed.message
                        await context.abort(status_code(closed.code), closed.message)
                    return
                if reader.done():
                    if heard.malformed:
                        reason = f"malformed Session message: {heard.malformed}"
                        log.warning("%s: %s", session.worker.describe(), reason)
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, heard.malformed)
                    if heard.left:
                        reason = f"left: {heard.left}"
                    return
                # A frozen or dead worker, or a lost network, fails grpc's keepalive within
                # liveness_s and ends the call; this catches a Python that stopped while its
                # process still answers pings (README: "Liveness").
                if time.monotonic() - heard.at > heartbeat_s:
                    reason = (
                        f"no heartbeat for {heartbeat_s} s while its connection answered "
                        "keepalive pings (the worker's Python is blocked; --heartbeat-timeout-s)"
                    )
                    await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
                if not await send(context, HEARTBEAT if message is None else message):
                    return
        finally:
            reader.cancel()
            if heard.left and reason == SESSION_CLOSED:  # it said why, then hung up
                reason = f"left: {heard.left}"
            self.controller.close_session(session, reason)

    async def Publish(  # noqa: N802
        self,
        request_iterator: AsyncIterator[afd_pb2.AFDControlPayload],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[afd_pb2.PublishAck]:
        async for ack in publish_stream.serve(self.controller, request_iterator, context):
            yield ack

    async def PublishBatch(  # noqa: N802
        self,
        request_iterator: AsyncIterator[afd_pb2.AFDControlPayloads],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[afd_pb2.PublishAck]:
        payloads = publish_stream.unbatched(request_iterator)
        async for ack in publish_stream.serve(self.controller, payloads, context):
            yield ack


class InspectServicer(afd_pb2_grpc.AFDInspectServicer):
    def __init__(
        self,
        controller: Controller,
        request_stop: Callable[[str], int],
        tap_limits: WatchLimits | None = None,
    ) -> None:
        self.controller = controller
        self.request_stop = request_stop
        self.tap_limits = tap_limits or WatchLimits(1 << 30, 1 << 30, TAP)

    async def GetStatus(  # noqa: N802
        self, request: afd_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> afd_pb2.Status:
        return self.controller.status()

    async def ListWorkers(  # noqa: N802
        self, request: afd_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> afd_pb2.ListWorkersResponse:
        role: str | None = None
        if request.role != afd_pb2.ROLE_UNSPECIFIED:
            if request.role not in PROTO_TO_ROLE:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"role {request.role} is not ATTENTION, FFN or ROLE_UNSPECIFIED",
                )
            role = PROTO_TO_ROLE[request.role]
        return afd_pb2.ListWorkersResponse(workers=self.controller.list_workers(role))

    async def Tap(  # noqa: N802
        self, request: afd_pb2.TapRequest, context: grpc.aio.ServicerContext
    ) -> None:
        peer = context.peer()
        why = self.tap_limits.acquire(peer)
        if why is not None:
            await refuse(context, why)
            return
        tap = self.controller.taps.add(request.include_payloads, peer)
        try:
            # Headers now, not with the first event: the client can tell it is subscribed.
            await context.send_initial_metadata(())
            while True:
                try:
                    event = await tap.mailbox.get()
                except MailboxClosed as closed:
                    if closed.code != "OK":
                        await context.abort(status_code(closed.code), closed.message)
                    return
                if event is None:  # only a get() with a timeout returns None
                    continue
                if not await send(context, event):
                    return
                if event.HasField("payload"):
                    tap.mailbox.last_step_id = event.payload.step_id
        finally:
            self.controller.taps.remove(tap)
            self.tap_limits.release(peer)

    async def Stop(  # noqa: N802
        self, request: afd_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> afd_pb2.StopResponse:
        reason = clip(request.reason) or f"afd-ctl stop from {context.peer()}"
        return afd_pb2.StopResponse(ffn_workers_told=self.request_stop(reason))

    async def Scale(  # noqa: N802
        self, request: afd_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> afd_pb2.ScaleResponse:
        reason = clip(request.reason) or f"afd-ctl scale from {context.peer()}"
        r = request
        try:
            message = self.controller.scale(r.attention, r.ffn, r.expert_parallel_size, reason)
        except ControlError as error:
            # In the daemon's log too: the asker may not show what it was told.
            SCALE_REFUSED.warn(
                f"to {r.attention}:{r.ffn} from {context.peer()}: {error.code}: {error.message}"
            )
            await abort(context, error)
            raise  # abort raises; this line is for the type checker
        return scale_reply(self.controller, message)

    async def GetTimings(  # noqa: N802
        self, request: afd_pb2.GetTimingsRequest, context: grpc.aio.ServicerContext
    ) -> afd_pb2.Timings:
        return self.controller.timing.timings()

    async def Trace(  # noqa: N802
        self, request: afd_pb2.TraceRequest, context: grpc.aio.ServicerContext
    ) -> afd_pb2.TraceResult:
        timeout_s = request.timeout_s if 0 < request.timeout_s <= 600 else DEFAULT_TRACE_TIMEOUT_S
        controller = self.controller
        trace: PendingTrace | None = None
        try:  # whatever happens, the trace's slot is released (issue 39)
            try:
                trace = controller.start_trace(request.steps)
            except ControlError as error:
                await abort(context, error)
                raise  # abort raises; this line is for the type checker
            deadline = time.monotonic() + timeout_s
            while not trace.complete and time.monotonic() < deadline:
                last = max(
                    trace.sent_at, controller.last_payload_at, controller.timing.last_report_at
                )
                if time.monotonic() - last > TRACE_IDLE_S:
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"no step ran for {TRACE_IDLE_S:.0f} s after the trace was asked (none "
                        "relayed, none reported): the pair is idle; send it requests and run "
                        "afd-ctl trace again",
                    )
                await asyncio.sleep(TRACE_POLL_S)
        finally:
            if trace is not None:
                controller.timing.end_trace(trace)
        if not trace.answers:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no worker sent the spans of steps {trace.first_step_id}.."
                f"{trace.first_step_id + trace.steps - 1} within {timeout_s:.0f} s: are steps "
                "running? (afd-ctl status shows the last step id)"
                + (f"; {'; '.join(trace.problems)}" if trace.problems else ""),
            )
        return trace.result()
