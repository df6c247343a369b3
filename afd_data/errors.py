"""Typed data-plane errors.

`AfdPeerLost` and `AfdStaleEpoch` are the control plane's own classes (`afd_ctl.errors`), so one
handler covers both planes; `AfdDataError` and `AfdProtocolError` live there too, for their
bases.

Every error says what went wrong and what the caller should do next, because the data plane
runs inside serving workers where a vague failure turns into a hang or a silent corruption.
"""

from __future__ import annotations

from afd_ctl.errors import AfdDataError, AfdPeerLost, AfdProtocolError, AfdStaleEpoch

__all__ = ["AfdBadInput", "AfdDataError", "AfdPeerLost", "AfdProtocolError", "AfdStaleEpoch"]


class AfdBadInput(AfdDataError, ValueError):
    """The caller passed something the transport cannot honour; nothing was sent or changed."""
