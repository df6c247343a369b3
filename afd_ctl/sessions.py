"""A worker's session on the daemon and who may publish as its worker.

A Session is one registration: the worker, its outgoing mailbox and the secret its Publish
streams must show. Plain Python, no gRPC.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from afd_ctl.errors import ControlError
from afd_ctl.logs import clip
from afd_ctl.mailbox import Mailbox
from afd_ctl.membership import Worker
from afd_ctl.v1 import afd_pb2
from afd_ctl.wire import PUBLISH_SECRET_METADATA, WORKER_ID_METADATA


@dataclass
class Session:
    worker: Worker
    mailbox: Mailbox[afd_pb2.SessionMessage]
    # Handed to the worker in its Registered answer; a Publish stream must show it (once, when
    # it opens) to act as this worker.
    publish_secret: str = ""
    # Set when the session ends: publish streams bound to it stop being accepted.
    ended: bool = False


def publishing_session(sessions: dict[str, Session], worker_id: str, secret: str) -> Session:
    """The session a new Publish stream acts for: the one registered as `worker_id`, if
    `secret` is the one its registration was given. Checked once per stream, not per
    payload; the stream stays bound to that session and dies with it."""
    if not worker_id:
        raise ControlError(
            "INVALID_ARGUMENT",
            f"call metadata {WORKER_ID_METADATA!r} is missing: name the registered attention "
            "worker that publishes",
        )
    session = sessions.get(worker_id)
    if session is None:
        raise ControlError(
            "FAILED_PRECONDITION",
            f"{WORKER_ID_METADATA} {clip(worker_id)!r} has no live session; register first "
            "(or again, after it was lost)",
        )
    if not secret:
        raise ControlError(
            "PERMISSION_DENIED",
            f"call metadata {PUBLISH_SECRET_METADATA!r} is missing: only the client that "
            f"registered {clip(worker_id)!r} may publish as it, with the publish_secret of "
            "its Registered answer",
        )
    if not hmac.compare_digest(secret.encode(), session.publish_secret.encode()):
        raise ControlError(
            "PERMISSION_DENIED",
            f"{PUBLISH_SECRET_METADATA} is not the one issued to the session of "
            f"{clip(worker_id)!r}: only the client that registered a worker may publish as "
            "it (an old secret stops working when its session ends)",
        )
    return session


def end_session(session: Session, last: afd_pb2.MembershipEvent) -> None:
    """Ends `session` from the daemon's side after `last` (RETIRED: a planned change left its
    worker out); its publish streams stop being accepted."""
    session.ended = True
    session.mailbox.offer(afd_pb2.SessionMessage(event=last))
    session.mailbox.close("OK", last.reason)
