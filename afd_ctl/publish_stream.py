"""The daemon's side of a sender's Publish and PublishBatch streams: the stream is bound to
the sender's session once, when it opens (its worker id and publish secret); then each payload,
alone or in a batch, is checked and fanned out by `Controller.publish`, and only a refused one
is answered (PublishAck)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from afd_ctl.aio_calls import abort, status_code
from afd_ctl.controller import Controller
from afd_ctl.errors import ControlError
from afd_ctl.logs import RateLimitedLog, clip
from afd_ctl.v1 import afd_pb2
from afd_ctl.wire import PUBLISH_SECRET_METADATA, WORKER_ID_METADATA, text_metadata

log = logging.getLogger(__name__)

# Publish streams refused when they open, rate-limited: anyone who can reach the port can
# send them as fast as they like.
PUBLISH_REFUSED = RateLimitedLog(log, "publish stream refused")


async def unbatched(
    requests: AsyncIterator[afd_pb2.AFDControlPayloads],
) -> AsyncIterator[afd_pb2.AFDControlPayload]:
    async for batch in requests:
        for payload in batch.payloads:
            yield payload


async def serve(
    controller: Controller,
    payloads: AsyncIterator[afd_pb2.AFDControlPayload],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[afd_pb2.PublishAck]:
    """One sender's stream of payloads in step order; yields the acks of refused ones."""
    metadata = text_metadata(context.invocation_metadata())
    worker_id = metadata.get(WORKER_ID_METADATA, "")
    try:
        # Checked once, here: the stream is bound to that session from now on.
        session = controller.publisher(worker_id, metadata.get(PUBLISH_SECRET_METADATA, ""))
    except ControlError as error:
        PUBLISH_REFUSED.warn(f"from {context.peer()}: {error.message}")
        await abort(context, error)
        return
    publish = controller.publish
    rejections = RateLimitedLog(log, f"payloads from {clip(worker_id)!r} rejected")
    async for payload in payloads:
        try:
            publish(session, payload)
        except ControlError as error:
            rejections.warn(f"step {payload.step_id}: {error.message}")
            rejected = afd_pb2.PublishRejected(
                step_id=payload.step_id,
                code=status_code(error.code).value[0],
                message=error.message,
                reason=error.reason or "REASON_UNSPECIFIED",  # the enum by name
            )
            yield afd_pb2.PublishAck(rejected=rejected)
            if session.ended:
                return  # the client opens a new stream for its new registration
