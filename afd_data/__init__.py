"""afd_data: the AFD data plane, hidden states attention <-> FFN over NIXL.

``NixlTransport`` (and NIXL with it) is imported lazily, so config, blob and error types are
usable where NIXL is not installed (the control plane, tools).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from afd_ctl.routing import Role
from afd_data.config import TransportConfig
from afd_data.errors import (
    AfdBadInput,
    AfdDataError,
    AfdPeerLost,
    AfdProtocolError,
    AfdStaleEpoch,
)
from afd_data.step_plan import PeerSlice

if TYPE_CHECKING:
    from afd_data.endpoints import HiddenBatch
    from afd_data.nixl_transport import NixlTransport, PeerSpec

__all__ = [
    "AfdBadInput",
    "AfdDataError",
    "AfdPeerLost",
    "AfdProtocolError",
    "AfdStaleEpoch",
    "HiddenBatch",
    "NixlTransport",
    "PeerSlice",
    "PeerSpec",
    "Role",
    "TransportConfig",
]

_LAZY = {"HiddenBatch", "NixlTransport", "PeerSpec"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from afd_data import endpoints, nixl_transport

        return getattr(endpoints if name == "HiddenBatch" else nixl_transport, name)
    raise AttributeError(f"module 'afd_data' has no attribute {name!r}")
