"""Kept only so that imports of ``afd_data.routing`` keep working while the transport split is
in flight: roles and the routing rule live in ``afd_ctl.routing``, their one home. Import from
there; this module goes once nothing imports it.
"""

from __future__ import annotations

from afd_ctl.routing import Role, max_peers, peer_ranks

__all__ = ["Role", "max_peers", "peer_ranks"]
