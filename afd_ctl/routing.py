"""Roles and the M:N routing between attention and FFN role ranks: the one home of both, used
by the daemon, the worker client, the data plane (`afd_data`) and the vLLM plugin. Plain
Python: importing it pulls in neither gRPC nor NIXL.

With g = min(M, N), attention rank a talks to FFN rank f iff a % g == f % g. That covers every
ratio: M >= N (several attention ranks share an FFN rank: 2:1, 3:2) and M < N (one attention
rank fans out to several expert-parallel FFN ranks: 1:2). Only attention ranks below g publish
control payloads; sender s reaches exactly the FFN ranks f with f % g == s, so every FFN rank
has one sender and the payload's DP metadata (global after vLLM's DP all-reduce) covers all.
Peers are always ordered by role rank: an FFN worker packs the hidden states of its attention
peers in that order, and an attention worker gets one output per FFN peer in that order.
"""

from __future__ import annotations

import enum

_PROTO = {"ATTENTION": 1, "FFN": 2}  # afd.v1.Role and afd.data.v1.Role numbers


class Role(enum.StrEnum):
    """Which half of the model a worker runs.

    A str equal to the protobuf enum's name ("ATTENTION", "FFN"), so the daemon's tables keyed
    by those names take it as is; `proto` is the wire number and `label` the lower-case word
    that logs, flags and metrics use. Convert at the edge with `parse` or `from_proto`."""

    ATTENTION = "ATTENTION"
    FFN = "FFN"

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
            return cls.from_proto(int(value))
        except (TypeError, ValueError):
            raise ValueError(f"role {value!r} is not 1 (attention) or 2 (ffn)") from None

    @classmethod
    def from_proto(cls, number: int) -> Role:
        """The role of a protobuf enum number; ValueError for ROLE_UNSPECIFIED or unknown."""
        for role in cls:
            if role.proto == number:
                return role
        raise ValueError(f"role {number!r} is not 1 (attention) or 2 (ffn)")

    @property
    def proto(self) -> int:
        return _PROTO[self.value]

    @property
    def other(self) -> Role:
        return Role.FFN if self is Role.ATTENTION else Role.ATTENTION

    @property
    def label(self) -> str:
        return self.value.lower()


def group_count(num_attention: int, num_ffn: int) -> int:
    if num_attention < 1 or num_ffn < 1:
        raise ValueError(f"need at least one worker per role, got {num_attention}:{num_ffn}")
    return min(num_attention, num_ffn)


def ffn_ranks_for(attention_rank: int, num_attention: int, num_ffn: int) -> list[int]:
    """FFN role ranks that attention rank `attention_rank` exchanges hidden states with."""
    g = group_count(num_attention, num_ffn)
    return [f for f in range(num_ffn) if f % g == attention_rank % g]


def attention_ranks_for(ffn_rank: int, num_attention: int, num_ffn: int) -> list[int]:
    """Attention role ranks whose hidden states FFN rank `ffn_rank` receives, in rank order."""
    g = group_count(num_attention, num_ffn)
    return [a for a in range(num_attention) if a % g == ffn_rank % g]


def ffn_group(ffn_rank: int, num_attention: int, num_ffn: int) -> list[int]:
    """The FFN role ranks that serve the same attention ranks as `ffn_rank` (its group), in
    rank order: with more FFN than attention ranks they split the experts between them."""
    return ffn_ranks_for(sender_for(ffn_rank, num_attention, num_ffn), num_attention, num_ffn)


def sender_ranks(num_attention: int, num_ffn: int) -> list[int]:
    """Attention role ranks that publish the per-step payload."""
    return list(range(group_count(num_attention, num_ffn)))


def sender_for(ffn_rank: int, num_attention: int, num_ffn: int) -> int:
    """The attention rank whose payloads FFN rank `ffn_rank` receives."""
    return ffn_rank % group_count(num_attention, num_ffn)


def subscriber_ranks(sender_rank: int, num_attention: int, num_ffn: int) -> list[int]:
    """FFN role ranks that receive what attention rank `sender_rank` publishes (none unless it
    is a sender)."""
    return [f for f in range(num_ffn) if sender_for(f, num_attention, num_ffn) == sender_rank]


def peer_ranks(role: Role, role_rank: int, num_attention: int, num_ffn: int) -> tuple[int, ...]:
    """Role ranks of the other role that `role_rank` exchanges tensors with, ascending."""
    if role is Role.ATTENTION:
        return tuple(ffn_ranks_for(role_rank, num_attention, num_ffn))
    return tuple(attention_ranks_for(role_rank, num_attention, num_ffn))


def max_peers(role: Role, num_attention: int, num_ffn: int) -> int:
    """Most peers any rank of `role` has: the number of receive areas its buffers hold."""
    g = group_count(num_attention, num_ffn)
    count = num_ffn if role is Role.ATTENTION else num_attention
    return -(-count // g)
