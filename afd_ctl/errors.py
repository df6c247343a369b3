"""Typed errors, shared by the daemon's domain code, the worker client and the data plane.

`ControlError` is what the daemon's plain-Python state raises; the gRPC layer maps its `code`
(a grpc.StatusCode name) to a status. `AfdError` and its subclasses are what workers see.
`AfdDataError` is the data plane's base (`afd_data.errors` re-exports it); it lives here so that
the two errors both planes raise, `AfdPeerLost` and `AfdStaleEpoch`, are one class each and
one handler covers both planes.
"""

from __future__ import annotations


class ControlError(Exception):
    """A request the daemon refuses. `code` is a grpc.StatusCode name, `str(self)` names the field;
    `reason`, for a refused payload, is a PublishRejected.Reason name so that clients need not
    read the words."""

    def __init__(self, code: str, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


def invalid(message: str, reason: str = "") -> ControlError:
    return ControlError("INVALID_ARGUMENT", message, reason)


class AfdError(Exception):
    """Base of every error the worker client raises."""


class AfdDataError(Exception):
    """Base of every data-plane error."""


class AfdProtocolError(AfdDataError):
    """A peer sent something this transport did not expect (a notification for an unknown
    step, layer or source, a malformed message, a row count that disagrees with the payload).

    The offending message was dropped; the transport itself stays usable.
    """


class AfdStopped(AfdError):
    """The attention side or an operator stopped the job: exit cleanly."""


class AfdControllerUnreachable(AfdError):
    """The daemon cannot be reached; the client keeps reconnecting in the background."""


class AfdNotReady(AfdError):
    """The expected set of workers is not complete yet."""


class AfdTimeout(AfdError):
    """A bounded wait ran out."""


class AfdRejected(AfdError):
    """The daemon refused a request. `code` is the grpc.StatusCode name; the message names the field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AfdPeerLost(AfdError, AfdDataError):
    """A worker this one depends on was lost (afd-ctl reported it, or the data plane saw it
    die, disconnect or miss its bound); wait for the set to be complete again and reconnect
    with the control plane's new epoch.

    The message always starts with ``afd peer lost:`` so that logs can be grepped for it.
    `peer` names the lost peer when the data plane knows it; `epoch` is the membership epoch
    after the loss, when known."""

    def __init__(self, detail: str, *, peer: str | None = None, epoch: int | None = None):
        super().__init__(f"afd peer lost: {detail}")
        self.peer = peer
        self.epoch = epoch


class AfdStaleEpoch(AfdRejected, AfdProtocolError):
    """Something names an older membership epoch than the receiver's: a payload the daemon
    refused (`code` is then the grpc.StatusCode name), or a data-plane message or payload."""

    def __init__(self, message: str, *, code: str = "") -> None:
        Exception.__init__(self, f"{code}: {message}" if code else message)
        self.code = code
        self.message = message
