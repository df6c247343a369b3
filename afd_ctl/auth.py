"""Bearer-token check for every RPC except grpc.health.v1 (load balancers probe it bare)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

EXEMPT_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        if given and hmac.compare_digest(given.encode(), self._expected):
            return handler
        message = (
            "authorization metadata is missing: send 'authorization: Bearer TOKEN'"
            if not given
            else "authorization token is wrong"
        )
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
