"""StepPlan: who sends how many rows where in one step, from the payload's DP metadata.

Plain Python (no NIXL), computed once per step in ``begin_step`` so the per-layer hot path only
looks numbers up. Attention DP rank ``d`` contributes ``max(1, num_tokens_across_dp[stage][d])``
rows (an idle rank sends one dummy row); an FFN rank packs its attention peers' rows back to
back in role-rank order, so an attention rank's offset in an FFN peer's batch is the sum of the
rows of the peers packed before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from afd_ctl.routing import Role, peer_ranks
from afd_data.config import TransportConfig
from afd_data.errors import AfdBadInput


@dataclasses.dataclass(frozen=True)
class PeerSlice:
    """One attention peer's rows in the FFN side's packed batch."""

    role_rank: int
    dp_rank: int
    start: int
    rows: int
    # The payload's token count; 0 means the single row is a dummy.
    num_tokens: int


@dataclasses.dataclass
class StepPlan:
    """Per stage: what this rank sends and expects. Empty until the first begin_step."""

    counts: list[list[int]] = dataclasses.field(default_factory=list)
    # Attention: rows this rank sends, and its row offset in each FFN peer's batch.
    my_rows: list[int] = dataclasses.field(default_factory=list)
    offsets: list[list[int]] = dataclasses.field(default_factory=list)
    # FFN: the packed batch.
    slices: list[tuple[PeerSlice, ...]] = dataclasses.field(default_factory=list)
    total_rows: list[int] = dataclasses.field(default_factory=list)
    # Both: rows expected from each peer (by role rank).
    rows_by_rank: list[dict[int, int]] = dataclasses.field(default_factory=list)


def validate_counts(config: TransportConfig, value: Sequence[Sequence[int]]) -> list[list[int]]:
    """Checks ``num_tokens_across_dp`` per stage (a `Step`'s counts) against the registered
    buffers; AfdBadInput names the offending entry."""
    stages = list(value)
    if not 1 <= len(stages) <= config.num_stages:
        raise AfdBadInput(
            f"num_tokens_across_dp has {len(stages)} stage(s); this transport carries 1 to "
            f"{config.num_stages} (TransportConfig.num_stages)"
        )
    counts: list[list[int]] = []
    for s, per_dp in enumerate(stages):
        row = [int(c) for c in per_dp]
        if len(row) != config.attention_dp_size:
            raise AfdBadInput(
                f"num_tokens_across_dp[stage {s}] has {len(row)} entries, the attention DP "
                f"size is {config.attention_dp_size} (num_attention {config.num_attention} / "
                f"attention_tp_size {config.attention_tp_size})"
            )
        for d, c in enumerate(row):
            if c < 0:
                raise AfdBadInput(f"num_tokens_across_dp[stage {s}][dp {d}] = {c} is negative")
            if c > config.max_tokens_per_peer:
                raise AfdBadInput(
                    f"num_tokens_across_dp[stage {s}][dp {d}] = {c} exceeds "
                    f"max_tokens_per_peer {config.max_tokens_per_peer}, what the registered "
                    "buffers hold per attention DP rank and stage; raise "
                    "TransportConfig.max_tokens_per_peer on every worker or split the batch"
                )
        counts.append(row)
    return counts


def plan_step(
    config: TransportConfig, role: Role, role_rank: int, counts: list[list[int]]
) -> StepPlan:
    """The plan of one step for ``role_rank`` from validated counts."""
    m, n, tp = config.num_attention, config.num_ffn, config.attention_tp_size
    g = config.ffn_groups
    mine = peer_ranks(role, role_rank, m, n, groups=g)
    plan = StepPlan(counts=counts)
    for per_dp in counts:
        rows = [max(1, per_dp[a // tp]) for a in range(m)]
        if role is Role.ATTENTION:
            plan.my_rows.append(rows[role_rank])
            plan.offsets.append(
                [
                    sum(rows[a] for a in peer_ranks(Role.FFN, f, m, n, groups=g) if a < role_rank)
                    for f in mine
                ]
            )
            plan.rows_by_rank.append({f: rows[role_rank] for f in mine})
        else:
            slices, start = [], 0
            for a in mine:
                slices.append(PeerSlice(a, a // tp, start, rows[a], per_dp[a // tp]))
                start += rows[a]
            plan.slices.append(tuple(slices))
            plan.total_rows.append(start)
            plan.rows_by_rank.append({a: rows[a] for a in mine})
    return plan
