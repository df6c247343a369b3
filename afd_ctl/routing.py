"""Roles and the M:N routing between attention and FFN role ranks: the one home of both, used
by the daemon, the worker client, the data plane (`afd_data`) and the vLLM plugin. Plain
Python: importing it pulls in neither gRPC nor NIXL.

The FFN ranks form g groups (1 <= g <= min(M, N)); attention rank a talks to FFN rank f iff
a % g == f % g, and the FFN ranks of one group split the experts between them (expert
parallelism). Every function takes `groups` (g); None means g = min(M, N), the default: M >= N
gives each FFN rank its own group that several attention ranks share (2:1, 3:2), M < N fans one
attention rank out to several expert-parallel FFN ranks (1:2). A deployment that wants every
FFN rank to hold 1/N of the experts (DeepSeek-V3) runs ONE group that every attention rank
reaches (all-to-all bipartite); users set it as the expert-parallel size E = N / g
(`groups_for_expert_parallel`, afd-ctl serve --expert-parallel-size).

Only attention ranks below g publish control payloads; sender s reaches exactly the FFN ranks
f with f % g == s, so every FFN rank has one sender and the payload's DP metadata (global after
vLLM's DP all-reduce) covers all. Peers are always ordered by role rank: an FFN worker packs
the hidden states of its attention peers in that order, and an attention worker gets one
output per FFN peer in that order (and sums them: each FFN peer ran its share of the experts).
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


EXPERT_PARALLEL_FLAG = "--expert-parallel-size"


def group_count(num_attention: int, num_ffn: int, groups: int | None = None) -> int:
    """The number of FFN groups g: `groups`, checked against M and N, or min(M, N)."""
    if num_attention < 1 or num_ffn < 1:
        raise ValueError(f"need at least one worker per role, got {num_attention}:{num_ffn}")
    most = min(num_attention, num_ffn)
    if groups is None:
        return most
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= most:
        raise ValueError(
            f"{groups!r} FFN groups for {num_attention}:{num_ffn} (attention:ffn): the number of "
            f"groups must be in 1..{most} ({EXPERT_PARALLEL_FLAG} E sets it to N / E)"
        )
    return groups


def groups_for_expert_parallel(num_attention: int, num_ffn: int, expert_parallel_size: int) -> int:
    """The number of FFN groups for expert-parallel size E (FFN ranks per group, each holding
    1/E of the experts): N / E. ValueError, saying what to change, when E does not divide N or
    leaves a group without an attention rank (N / E > M)."""
    m, n, e = num_attention, num_ffn, expert_parallel_size
    if m < 1 or n < 1:
        raise ValueError(f"need at least one worker per role, got {m}:{n}")
    if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= n:
        raise ValueError(
            f"{EXPERT_PARALLEL_FLAG} {e!r} must be in 1..{n} (the FFN ranks, --expect-ffn)"
        )
    if n % e:
        raise ValueError(
            f"{EXPERT_PARALLEL_FLAG} {e} does not divide the {n} FFN ranks (--expect-ffn); "
            f"use a divisor of {n}, such as {n} (one group: every FFN rank holds 1/{n} of the "
            "experts)"
        )
    if n // e > m:
        raise ValueError(
            f"{EXPERT_PARALLEL_FLAG} {e} makes {n // e} FFN groups but there are only {m} "
            f"attention ranks (--expect-attention) to feed them; use an expert-parallel size of "
            f"at least {-(-n // m)} that divides {n}, or more attention ranks"
        )
    return n // e


def ffn_ranks_for(
    attention_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> list[int]:
    """FFN role ranks that attention rank `attention_rank` exchanges hidden states with."""
    g = group_count(num_attention, num_ffn, groups)
    return [f for f in range(num_ffn) if f % g == attention_rank % g]


def attention_ranks_for(
    ffn_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> list[int]:
    """Attention role ranks whose hidden states FFN rank `ffn_rank` receives, in rank order."""
    g = group_count(num_attention, num_ffn, groups)
    return [a for a in range(num_attention) if a % g == ffn_rank % g]


def ffn_group(
    ffn_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> list[int]:
    """The FFN role ranks that serve the same attention ranks as `ffn_rank` (its group), in
    rank order: they split the experts between them."""
    sender = sender_for(ffn_rank, num_attention, num_ffn, groups=groups)
    return ffn_ranks_for(sender, num_attention, num_ffn, groups=groups)


def sender_ranks(num_attention: int, num_ffn: int, *, groups: int | None = None) -> list[int]:
    """Attention role ranks that publish the per-step payload."""
    return list(range(group_count(num_attention, num_ffn, groups)))


def sender_for(
    ffn_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> int:
    """The attention rank whose payloads FFN rank `ffn_rank` receives."""
    return ffn_rank % group_count(num_attention, num_ffn, groups)


def subscriber_ranks(
    sender_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> list[int]:
    """FFN role ranks that receive what attention rank `sender_rank` publishes (none unless it
    is a sender)."""
    g = group_count(num_attention, num_ffn, groups)
    return [f for f in range(num_ffn) if f % g == sender_rank]


def peer_ranks(
    role: Role, role_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> tuple[int, ...]:
    """Role ranks of the other role that `role_rank` exchanges tensors with, ascending."""
    if role is Role.ATTENTION:
        return tuple(ffn_ranks_for(role_rank, num_attention, num_ffn, groups=groups))
    return tuple(attention_ranks_for(role_rank, num_attention, num_ffn, groups=groups))


def max_peers(role: Role, num_attention: int, num_ffn: int, *, groups: int | None = None) -> int:
    """Most peers any rank of `role` has: the number of receive areas its buffers hold."""
    g = group_count(num_attention, num_ffn, groups)
    count = num_ffn if role is Role.ATTENTION else num_attention
    return -(-count // g)


def lockstep_conflict(
    num_attention: int, groups: int, lockstep_size: int
) -> tuple[int, int] | None:
    """Two attention ranks that would share an FFN group although they are in different
    lockstep blocks (rank a is in block a // lockstep_size; 0: one block of every rank), or
    None. An FFN group waits for the hidden states of each of its attention ranks every step,
    so ranks that do not run their steps together (two `vllm serve` servers) cannot share one."""
    if lockstep_size <= 0:
        return None
    for group in range(min(groups, num_attention)):
        ranks = range(group, num_attention, groups)
        first = ranks[0]
        for other in ranks[1:]:
            if other // lockstep_size != first // lockstep_size:
                return first, other
    return None
