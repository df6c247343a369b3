"""A re-export, no logic: roles and the routing rule live in ``afd_ctl.routing``, their one
home. Kept so that existing imports of ``afd_data.routing`` (the data-plane tests, the transport
split in flight) keep working; new code imports ``afd_ctl.routing``.
"""

from __future__ import annotations

from afd_ctl.routing import Role, max_peers, peer_ranks

__all__ = ["Role", "max_peers", "peer_ranks"]
