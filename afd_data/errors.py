"""Typed data-plane errors.

Every error says what went wrong and what the caller should do next, because the data plane
runs inside serving workers where a vague failure turns into a hang or a silent corruption.
"""

from __future__ import annotations

from afd_ctl import errors as control_errors


class AfdDataError(Exception):
    """Base of every data-plane error."""


class AfdBadInput(AfdDataError, ValueError):
    """The caller passed something the transport cannot honour; nothing was sent or changed."""


class AfdPeerLost(AfdDataError, control_errors.AfdPeerLost):
    """A peer died, disconnected, or missed its bound; the transport is unusable until
    ``reconnect()`` with the control plane's new epoch.

    The message always starts with ``afd peer lost:`` so that logs can be grepped for it. It
    is also an ``afd_ctl.errors.AfdPeerLost``, so one handler covers both planes.
    """

    def __init__(self, detail: str, *, peer: str | None = None, epoch: int | None = None):
        control_errors.AfdPeerLost.__init__(self, f"afd peer lost: {detail}", epoch=epoch)
        self.peer = peer


class AfdProtocolError(AfdDataError):
    """A peer sent something this transport did not expect (a notification for an unknown
    step, layer or source, a malformed message, a row count that disagrees with the payload).

    The offending message was dropped; the transport itself stays usable.
    """


class AfdStaleEpoch(AfdProtocolError):
    """A message or payload names an older membership epoch than the transport's."""
