"""AFDControlPayload token counts, written and read one way everywhere.

`max_tokens_across_dp` is always derived from the counts, so a payload built here passes the
daemon's check by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from afd_ctl.v1 import afd_pb2

StageCounts = Mapping[int, Sequence[int]] | Sequence[Sequence[int]]


def make_payload(step_id: int, counts: StageCounts, **flags: bool) -> afd_pb2.AFDControlPayload:
    """A payload for `step_id` with per-stage token counts (a list per stage, or a
    {stage: counts} map) and the given flags (is_warmup=True, ...)."""
    payload = afd_pb2.AFDControlPayload(step_id=step_id)
    for flag, value in flags.items():
        setattr(payload, flag, value)
    items = counts.items() if isinstance(counts, Mapping) else enumerate(counts)
    for stage, row in items:
        meta = payload.stages[stage]
        meta.num_tokens_across_dp.extend(row)
        meta.max_tokens_across_dp = max(row)
    return payload


def stage_counts(payload: afd_pb2.AFDControlPayload) -> dict[int, list[int]]:
    """The payload's per-stage token counts, {stage: counts}."""
    return {s: list(meta.num_tokens_across_dp) for s, meta in payload.stages.items()}
