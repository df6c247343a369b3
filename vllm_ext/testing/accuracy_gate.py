"""The accuracy gate (issue 23): is a run's numerics as close to vLLM's colocated run as vLLM's
own two accepted numerics (eager and compiled) are to each other?

Teacher forcing makes the comparison immune to near-ties: both sides score the *same* tokens
(the reference's greedy continuation) with vLLM's prompt log-probs, so one flipped argmax
cannot send the rest of a sequence elsewhere and make everything after it look different.
Free-running greedy divergence is still reported, as information.

Pure logic: the vLLM runs that produce the inputs are vllm_ext.testing.accuracy_run.

A run (what accuracy_run writes, one entry per prompt):
    {"prompt_ids": [[...]], "generated": [[...]], "scored": [[...]],
     "logprobs": [[...]], "top1": [[...]]}
`scored` is the continuation that was scored (the reference's `generated`), `logprobs[i][t]`
the log-prob of `scored[i][t]` given the prompt and `scored[i][:t]`, `top1[i][t]` the
argmax token at that position.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

# The rule: AFD's p99 and median |d log-prob| at most FACTOR x the envelope's, its
# top-1 agreement at least the envelope's minus TOP1_SLACK_POINTS.
FACTOR = 1.5
TOP1_SLACK_POINTS = 0.5
# The least a |d log-prob| bound can be, in nats. Without it an envelope of bit-identical
# numerics (eager and compiled agreeing exactly, as fp32 CPU runs can) would demand AFD be
# bit-identical too, and a 1:N expert split that sums the same partial outputs in another order
# (a last-bit difference in fp32, one bf16 rounding in bf16: about 1e-3 nats on these models)
# would fail without a bug. The floors sit 1-2 orders of magnitude below what a real bug does:
# one swapped row in one layer moves the p99 by > 1 nat on the tiny models (the fault run in
# benchmarks/results/*_accuracy_gate.json), a wrong expert or stale slot likewise.
P99_FLOOR = 0.02
MEDIAN_FLOOR = 0.005


def prompt_token_ids(
    n: int,
    vocab_size: int,
    *,
    seed: int = 0,
    min_len: int = 4,
    max_len: int = 128,
    reserved: int = 2,
) -> list[list[int]]:
    """`n` prompts of random token ids (ids below `reserved`, BOS/EOS, left out), lengths
    spread evenly from min_len to max_len, so both short and long contexts are scored."""
    rng = random.Random(seed)
    lengths = [min_len + (max_len - min_len) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(reserved, vocab_size) for _ in range(k)] for k in lengths]


def position_scores(positions: list[Any], continuation: list[int]) -> tuple[list[float], list[int]]:
    """(log-prob of each continuation token, top-1 token at each position) from vLLM's prompt
    log-probs of the continuation's positions (the last len(continuation) of the prompt): dicts
    of token id -> Logprob offline, of str(token id) -> {"logprob", "rank"} over HTTP."""
    logprobs, top1 = [], []
    for tok, pos in zip(continuation, positions, strict=True):
        entries = {
            int(k): (v["logprob"], v["rank"]) if isinstance(v, dict) else (v.logprob, v.rank)
            for k, v in pos.items()
        }
        logprobs.append(float(entries[tok][0]))
        top1.append(next(k for k, (_, rank) in entries.items() if rank == 1))
    return logprobs, top1


def _quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default), of sorted values."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy generations differ, None if they never do."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclasses.dataclass(frozen=True)
class Stats:
    """One side against the reference, over every scored token."""

    tokens: int
    median_abs_dlogprob: float
    p99_abs_dlogprob: float
    max_abs_dlogprob: float
    top1_agreement_pct: float
    # Free-running greedy generation: per prompt the first position that differs (None: never).
    first_divergence: list[int | None]

    @property
    def prompts_diverged(self) -> int:
        return sum(d is not None for d in self.first_divergence)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        diverged = [x for x in self.first_divergence if x is not None]
        d["prompts_diverged"] = len(diverged)
        d["earliest_divergence"] = min(diverged) if diverged else None
        return d


def compare(reference: dict[str, Any], other: dict[str, Any]) -> Stats:
    """`other` against `reference`: both must have scored the same continuation."""
    if other["scored"] != reference["scored"]:
        raise ValueError("the two runs scored different continuations: not comparable")
    deltas: list[float] = []
    agree = total = 0
    for ref_lp, oth_lp, ref_top, oth_top in zip(
        reference["logprobs"], other["logprobs"], reference["top1"], other["top1"], strict=True
    ):
        deltas += [abs(a - b) for a, b in zip(ref_lp, oth_lp, strict=True)]
        agree += sum(a == b for a, b in zip(ref_top, oth_top, strict=True))
        total += len(ref_top)
    deltas.sort()
    divergence = [
        first_divergence(a, b)
        for a, b in zip(reference["generated"], other["generated"], strict=True)
    ]
    return Stats(
        tokens=len(deltas),
        median_abs_dlogprob=_quantile(deltas, 0.5),
        p99_abs_dlogprob=_quantile(deltas, 0.99),
        max_abs_dlogprob=deltas[-1] if deltas else 0.0,
        top1_agreement_pct=100.0 * agree / max(1, total),
        first_divergence=divergence,
    )


@dataclasses.dataclass(frozen=True)
class Verdict:
    passed: bool
    reasons: list[str]  # every bound that was crossed, with both numbers
    bounds: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "accuracy_gate": "pass" if self.passed else "fail",
            "reasons": self.reasons,
            "bounds": self.bounds,
        }


def verdict(stats: Stats, envelope: Stats) -> Verdict:
    """The issue's rule, each |d| bound at least its floor (see P99_FLOOR)."""
    bounds = {
        "p99_abs_dlogprob": max(FACTOR * envelope.p99_abs_dlogprob, P99_FLOOR),
        "median_abs_dlogprob": max(FACTOR * envelope.median_abs_dlogprob, MEDIAN_FLOOR),
        "top1_agreement_pct": envelope.top1_agreement_pct - TOP1_SLACK_POINTS,
    }
    reasons = [
        f"{name} {getattr(stats, name):.3g} > {bound:.3g}"
        for name, bound in bounds.items()
        if name != "top1_agreement_pct" and getattr(stats, name) > bound
    ]
    if stats.top1_agreement_pct < bounds["top1_agreement_pct"]:
        reasons.append(
            f"top1_agreement_pct {stats.top1_agreement_pct:.2f} < "
            f"{bounds['top1_agreement_pct']:.2f}"
        )
    return Verdict(passed=not reasons, reasons=reasons, bounds=bounds)


def gate_case(
    name: str, reference: dict[str, Any], run: dict[str, Any], envelope: Stats
) -> dict[str, Any]:
    """One case of the results JSON: the statistics, the envelope's and the verdict."""
    stats = compare(reference, run)
    return {
        "case": name,
        "stats": stats.to_json(),
        "envelope": envelope.to_json(),
        **verdict(stats, envelope).to_json(),
    }
