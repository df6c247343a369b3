"""The M:N routing between attention and FFN role ranks.

With g = min(M, N), attention rank a talks to FFN rank f iff a % g == f % g. That covers every
ratio: M >= N (several attention ranks share an FFN rank: 2:1, 3:2) and M < N (one attention
rank fans out to several expert-parallel FFN ranks: 1:2). Only attention ranks below g publish
control payloads; sender s reaches exactly the FFN ranks f with f % g == s, so every FFN rank
has one sender and the payload's DP metadata (global after vLLM's DP all-reduce) covers all.
"""

from __future__ import annotations


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


def sender_ranks(num_attention: int, num_ffn: int) -> list[int]:
    """Attention role ranks that publish the per-step payload."""
    return list(range(group_count(num_attention, num_ffn)))


def sender_for(ffn_rank: int, num_attention: int, num_ffn: int) -> int:
    """The attention rank whose payloads FFN rank `ffn_rank` receives."""
    return ffn_rank % group_count(num_attention, num_ffn)
