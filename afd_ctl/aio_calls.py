"""The daemon's side of a gRPC call: a domain error (ControlError) as the call's status, and
response-stream writes that end quietly when the client hung up."""

from __future__ import annotations

import asyncio

import grpc

from afd_ctl.errors import ControlError


def status_code(name: str) -> grpc.StatusCode:
    return grpc.StatusCode[name]


async def abort(context: grpc.aio.ServicerContext, error: ControlError) -> None:
    await context.abort(status_code(error.code), error.message)


async def send(context: grpc.aio.ServicerContext, message: object) -> bool:
    """Writes one message of a response stream; False when the client hung up meanwhile.

    A handler that yields leaves the write to grpcio, which logs a client that hung up during
    a blocked write (one that had stopped reading) as a 10-line ERROR traceback; written here,
    that is an ordinary end of the stream."""
    try:
        await context.write(message)
    except (grpc.aio.InternalError, grpc.aio.UsageError, asyncio.InvalidStateError):
        return False
    return True
