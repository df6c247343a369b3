"""One step, as every part of AFD sees it: from the moment vLLM decides the step's padding to the
FFN side's graph key.

A `Step` is the step id, the membership epoch it runs in, the token counts per stage (one entry
per attention DP rank; two stages under dual-batch overlap) and its flags. It converts to and
from the wire's `AFDControlPayload` in one place, and says the rules both sides apply to it:
which waits get the warm-up bound (`warmup`), and which CUDA graph a step runs (`graph_key`,
`graph_mode`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from afd_ctl.v1 import afd_pb2

Counts = tuple[tuple[int, ...], ...]
# Payloads per step shape (counts and flags), copied for each step of that shape.
MAX_TEMPLATES = 256
StageCounts = Mapping[int, Sequence[int]] | Sequence[Sequence[int]]
EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """What the attention side is doing in this step (the payload's flags)."""

    is_warmup: bool = False
    is_profile: bool = False
    is_graph_capturing: bool = False
    is_graph_replaying: bool = False
    # A FULL-graph capture of the GPU-driven exchange: recorded, run by neither side.
    records_only: bool = False

    @property
    def warmup(self) -> bool:
        """Compile or capture may run inside this step: its waits get the warm-up bound."""
        return self.is_warmup or self.is_profile or self.is_graph_capturing

    def replaying(self) -> StepFlags:
        return dataclasses.replace(self, is_graph_replaying=True)

    def graph_mode(self, graphs: bool = True) -> str:
        """EAGER, CAPTURE or REPLAY: what the FFN side does with its CUDA graphs. An eager step
        stays eager even when its counts equal a captured key (an eager prefill that happens
        to match a decode shape must not replay)."""
        if not graphs:
            return EAGER
        if self.is_graph_capturing:
            return CAPTURE
        if self.is_graph_replaying:
            return REPLAY
        return EAGER


@dataclasses.dataclass(frozen=True)
class Step:
    step_id: int
    counts: Counts
    epoch: int | None = None
    flags: StepFlags = StepFlags()

    @classmethod
    def of(
        cls,
        step_id: int,
        counts: StageCounts,
        *,
        epoch: int | None = None,
        flags: StepFlags | None = None,
    ) -> Step:
        """A step from per-stage counts: a list per stage, or a {stage: counts} map whose keys
        are 0..n-1 (ValueError otherwise)."""
        if isinstance(counts, Mapping):
            keys = sorted(counts)
            if keys != list(range(len(keys))):
                raise ValueError(f"num_tokens_across_dp: stage keys {keys} are not 0..n-1")
            counts = [counts[k] for k in keys]
        return cls(
            step_id,
            tuple(tuple(int(c) for c in row) for row in counts),
            epoch,
            flags or StepFlags(),
        )

    @classmethod
    def from_payload(cls, payload: afd_pb2.AFDControlPayload) -> Step:
        flags = StepFlags(
            is_warmup=payload.is_warmup,
            is_profile=payload.is_profile,
            is_graph_capturing=payload.is_graph_capturing,
            is_graph_replaying=payload.is_graph_replaying,
            records_only=payload.records_only,
        )
        counts = {s: meta.num_tokens_across_dp for s, meta in payload.stages.items()}
        return cls.of(payload.step_id, counts, epoch=payload.epoch, flags=flags)

    def to_payload(self) -> afd_pb2.AFDControlPayload:
        """The wire form (`max_tokens_across_dp` derived from the counts, so it passes the
        daemon's check by construction; the client stamps epoch and sender rank). Decode
        steps repeat a few shapes: each shape's payload is built once and copied (a quarter
        of the time, on the attention host's path of every step)."""
        key = (self.counts, self.flags)
        template = _TEMPLATES.get(key)
        if template is None:
            template = self._payload_of_shape()
            if len(_TEMPLATES) >= MAX_TEMPLATES:
                _TEMPLATES.clear()
            _TEMPLATES[key] = template
        payload = afd_pb2.AFDControlPayload()
        payload.CopyFrom(template)
        payload.step_id = self.step_id
        if self.epoch is not None:
            payload.epoch = self.epoch
        return payload

    def _payload_of_shape(self) -> afd_pb2.AFDControlPayload:
        f = self.flags
        payload = afd_pb2.AFDControlPayload(
            is_warmup=f.is_warmup,
            is_profile=f.is_profile,
            is_graph_capturing=f.is_graph_capturing,
            is_graph_replaying=f.is_graph_replaying,
            records_only=f.records_only,
        )
        for stage, row in enumerate(self.counts):
            meta = payload.stages[stage]
            meta.num_tokens_across_dp.extend(row)
            meta.max_tokens_across_dp = max(row)
        return payload

    @property
    def stages(self) -> int:
        return len(self.counts)

    @property
    def warmup(self) -> bool:
        return self.flags.warmup

    @property
    def graph_key(self) -> Counts:
        """The per-stage token counts: both sides key their CUDA graphs by them."""
        return self.counts

    def rows(self) -> int:
        """Rows of every stage and DP rank (an idle rank's dummy row counted)."""
        return sum(max(1, c) for row in self.counts for c in row)


_TEMPLATES: dict[tuple[Counts, StepFlags], afd_pb2.AFDControlPayload] = {}
