"""Typed errors, shared by the daemon's domain code and the worker client.

`ControlError` is what the daemon's plain-Python state raises; the gRPC layer maps its `code`
(a grpc.StatusCode name) to a status. `AfdError` and its subclasses are what workers see.
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


class AfdPeerLost(AfdError):
    """A worker this one depends on was lost; wait for the set to be complete again.

    `epoch` is the membership epoch after the loss, when known."""

    def __init__(self, message: str, *, epoch: int | None = None) -> None:
        super().__init__(message)
        self.epoch = epoch


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


class AfdStaleEpoch(AfdRejected):
    """The daemon refused a payload stamped with an older membership epoch."""
