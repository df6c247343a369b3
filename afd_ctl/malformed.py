"""Request bytes that do not parse: INVALID_ARGUMENT naming the field, one log line, no traceback.

grpcio answers a request deserializer that raises with UNKNOWN ("Unexpected DecodeError") and
logs a traceback. `MalformedRequestInterceptor` wraps every handler's deserializer, for every
service (ours, health, reflection): a unary request that does not parse becomes a `Malformed`
marker that the wrapped handler refuses before the servicer runs; inside a request stream the
deserializer raises `MalformedRequest`, which the wrapped handler turns into the same status.
(A servicer that reads its requests in a task of its own catches `MalformedRequest` itself.)
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from afd_ctl.logs import RateLimitedLog, clip
from afd_ctl.wire import Handler

log = logging.getLogger(__name__)
# How deep `locate` follows nested messages looking for the field to blame.
MAX_DEPTH = 16


class MalformedRequest(Exception):
    """Raised while iterating a request stream whose next message does not parse."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Malformed:
    """Stands in for a unary request that did not parse."""

    message: str


def _descriptor(deserializer: Callable[[bytes], Any]) -> Descriptor | None:
    owner = getattr(deserializer, "__self__", None)  # SomeMessage.FromString
    return getattr(owner, "DESCRIPTOR", None)


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value = shift = 0
    while pos < len(data) and shift < 70:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def locate(data: bytes, descriptor: Descriptor, depth: int = 0) -> str:
    """Where `data` stops being a valid `descriptor` message, as "field name: problem" (nested
    fields joined by dots); "" when no single field is to blame (or it is nested too deep)."""
    if depth > MAX_DEPTH:
        return ""
    pos = 0
    while pos < len(data):
        start = pos
        key = _varint(data, pos)
        if key is None:
            return f"byte {start}: truncated field key"
        number, wire, pos = key[0] >> 3, key[0] & 7, key[1]
        field = descriptor.fields_by_number.get(number)
        name = field.name if field is not None else f"field {number}"
        if number == 0:
            return f"byte {start}: field number 0 does not exist"
        if wire == 0:
            value = _varint(data, pos)
            if value is None:
                return f"{name}: truncated varint at byte {pos}"
            pos = value[1]
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                return f"{name}: {len(data) - pos} of {size} bytes at byte {pos}"
            pos += size
        elif wire == 2:
            length = _varint(data, pos)
            if length is None:
                return f"{name}: truncated length at byte {pos}"
            size, pos = length
            if pos + size > len(data):
                return f"{name}: says {size} bytes, {len(data) - pos} left"
            body, pos = data[pos : pos + size], pos + size
            if field is None:
                continue
            if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                inner = locate(body, field.message_type, depth + 1)
                if inner:
                    return f"{name}.{inner}" if not inner.startswith("byte") else f"{name}: {inner}"
            elif field.type == FieldDescriptor.TYPE_STRING:
                try:
                    body.decode()
                except UnicodeDecodeError:
                    return f"{name}: not valid UTF-8"
        else:
            return f"{name}: wire type {wire} is not valid here"
    return ""


def _explain(data: bytes, deserializer: Callable[[bytes], Any], error: Exception) -> str:
    descriptor = _descriptor(deserializer)
    if descriptor is None:
        return f"request bytes do not parse: {clip(str(error), 120)}"
    where = locate(data, descriptor)
    where = f" at {where}" if where else f" ({clip(str(error), 120)})"
    return (
        f"request bytes are not a valid {descriptor.full_name}{where}; build requests from "
        f"the published .proto (grpcurl: describe {descriptor.full_name})"
    )


def safe_deserializer(
    deserializer: Callable[[bytes], Any], streaming: bool
) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # any parse failure is the client's, not ours
            message = _explain(data, deserializer, error)
            if streaming:
                raise MalformedRequest(message) from None
            return Malformed(message)

    return parse


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._log = RateLimitedLog(log, "malformed request refused")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._wrap(handler, details.method)

    def _wrap(self, handler: Handler, method: str) -> Handler:
        deserializer = handler.request_deserializer
        if deserializer is None:  # nothing to parse (intercept_service passes none such)
            return handler
        streaming = handler.request_streaming
        if streaming and handler.response_streaming:
            behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        elif streaming:
            behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        elif handler.response_streaming:
            behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        else:
            behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        refuse = self._refuser(method)
        wrapped: Callable[..., Any]
        if inspect.isasyncgenfunction(behavior):

            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
                if isinstance(request, Malformed):
                    await refuse(context, request.message)
                try:
                    async for response in behavior(request, context):
                        yield response
                except MalformedRequest as error:
                    await refuse(context, error.message)

        elif inspect.iscoroutinefunction(behavior):

            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    await refuse(context, request.message)
                try:
                    return await behavior(request, context)
                except MalformedRequest as error:
                    await refuse(context, error.message)

        else:  # a sync handler: not used by this server
            return handler
        return factory(
            wrapped,
            request_deserializer=safe_deserializer(deserializer, streaming),
            response_serializer=handler.response_serializer,
        )

    def _refuser(self, method: str) -> Callable[[grpc.aio.ServicerContext, str], Awaitable[None]]:
        async def refuse(context: grpc.aio.ServicerContext, message: str) -> None:
            self._log.warn(f"{method} from {context.peer()}: {message}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        return refuse
