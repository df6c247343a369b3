"""Bearer-token check for every RPC except grpc.health.v1 (load balancers probe it bare).

Reflection is not exempt: it is part of the API like any other service, so grpcurl needs the
header too (README: `-H 'authorization: Bearer TOKEN'`)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from afd_ctl.wire import Handler, text_metadata

EXEMPT_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIX):
            return handler
        metadata = text_metadata(details.invocation_metadata)
        given = metadata.get("authorization", "")
        # RFC 7235: the scheme is case-insensitive ("bearer" too); the token is compared as is.
        scheme, _, token = given.strip().partition(" ")
        is_bearer = scheme.lower() == "bearer"
        if is_bearer and hmac.compare_digest(token.strip().encode(), self._token):
            return handler
        if not given:
            message = "authorization metadata is missing: send 'authorization: Bearer TOKEN'"
        elif not is_bearer:
            message = "authorization metadata is not a Bearer token: send 'Bearer TOKEN'"
        else:
            message = "authorization token is wrong"
        return _denying_handler(handler, message)


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    code = grpc.StatusCode.UNAUTHENTICATED

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover (makes this an async generator)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
