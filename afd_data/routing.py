"""Roles and the M:N routing rule, computed locally so both sides agree without messages.

Attention role rank ``a`` talks to FFN role rank ``f`` iff ``a % min(M, N) == f % min(M, N)``
(the daemon's rule, see ``afd.v1.View.routes``). Peers are always ordered by role rank: an FFN
worker packs the hidden states of its attention peers in that order, and an attention worker
gets one output per FFN peer in that order.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    """Which half of the model a worker runs; the values match ``afd.v1.Role``."""

    ATTENTION = 1
    FFN = 2

    @classmethod
    def parse(cls, value: Role | int | str) -> Role:
        """Accepts a Role, its proto number, or a name ("attention", "ffn", any case)."""
        if isinstance(value, Role):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(f"role {value!r} is not 'attention' or 'ffn'") from None
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(f"role {value!r} is not 1 (attention) or 2 (ffn)") from None

    @property
    def other(self) -> Role:
        return Role.FFN if self is Role.ATTENTION else Role.ATTENTION

    @property
    def label(self) -> str:
        return "attention" if self is Role.ATTENTION else "ffn"


def peer_ranks(role: Role, role_rank: int, num_attention: int, num_ffn: int) -> tuple[int, ...]:
    """Role ranks of the other role that ``role_rank`` exchanges tensors with, ascending."""
    k = min(num_attention, num_ffn)
    count = num_ffn if role is Role.ATTENTION else num_attention
    return tuple(r for r in range(count) if r % k == role_rank % k)


def max_peers(role: Role, num_attention: int, num_ffn: int) -> int:
    """Most peers any rank of ``role`` has: the number of receive areas its buffers hold."""
    k = min(num_attention, num_ffn)
    count = num_ffn if role is Role.ATTENTION else num_attention
    return -(-count // k)
