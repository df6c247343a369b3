"""Benchmark figures that refuse nonsense: per-request decode TPOT from vLLM's own timestamps,
spreads over repeats, ratios from medians with their range, and the checks a figure must pass
before it is written into a results JSON.

Pure Python (no vLLM, no torch), so the tests feed it timings directly.

Why per-request timestamps for TPOT: vLLM stamps every engine-core output with a monotonic
time, and keeps per request the stamp of the output that carried its first token and of the one
that carried its last (`RequestOutput.metrics.first_token_ts` / `last_token_ts`, vLLM 0.26 and
0.32 alike, when the engine logs stats). (last - first) / (tokens - 1) is then the decode steps
alone: the prefill, the scheduler's first step, the front end's start and end of `generate()`
all fall outside it, which is what `vllm bench serve` reports as TPOT too. The previous
(t(N tokens) - t(1 token)) / (N - 1) subtracted two wall times that each carry a prefill; one
slow 1-token run made it tiny or negative (issue 28).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Widest relative spread, (max - min) / median over repeats, a figure may have. GPU: an engine
# on its own GPU(s); two engines sharing one GPU (e2e_decode --one-gpu, with or without MPS)
# gave 0.24-0.29 over 5 repeats on an H200 (2026-12-01); the CPU machine is a shared 2-core
# host.
SPREAD_BOUND_GPU = 0.15
SPREAD_BOUND_GPU_SHARED = 0.35
SPREAD_BOUND_CPU = 0.5
# Decode tokens/s (from the batch's decode span) and batch / TPOT (per request) must agree
# this closely: they disagree when the requests did not decode together.
TOKENS_PER_S_TOLERANCE = 0.10
# A decode span may pass the front end's wall time of generate() by this much (two clocks).
WALL_TOLERANCE = 0.02


class BenchmarkRefused(RuntimeError):
    """A figure failed a check; the message names the figure and why. Nothing is recorded."""


@dataclass(frozen=True)
class RequestTiming:
    """One request of a timed generate(), from vLLM's RequestOutput.metrics (engine-core
    monotonic seconds)."""

    first_token_s: float
    last_token_s: float
    output_tokens: int
    preemptions: int = 0


@dataclass(frozen=True)
class Spread:
    """Min, median and max of one figure over repeats."""

    low: float
    median: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise BenchmarkRefused("no values to take a spread of")
        return cls(min(values), statistics.median(values), max(values), len(values))

    @property
    def relative(self) -> float:
        """(max - min) / median; infinite when the median is not positive."""
        return (self.high - self.low) / self.median if self.median > 0 else math.inf

    def as_dict(self, digits: int = 3) -> dict[str, float]:
        return {
            "min": round(self.low, digits),
            "median": round(self.median, digits),
            "max": round(self.high, digits),
            "n": self.n,
        }


@dataclass(frozen=True)
class Ratio:
    """a / b from medians, with the range the two spreads allow."""

    value: float
    low: float
    high: float

    def as_dict(self, digits: int = 3) -> dict[str, float]:
        return {
            "median": round(self.value, digits),
            "min": round(self.low, digits),
            "max": round(self.high, digits),
        }


@dataclass(frozen=True)
class DecodeRun:
    """One timed generate() of a batch: TPOT per request (median over the batch), decode
    tokens/s over the batch's decode span, and the front end's wall time around it."""

    tpot_s: float
    tokens_per_s: float
    decode_span_s: float
    wall_s: float
    batch: int


def positive(value: float, what: str) -> float:
    """`value` if it is a finite number above zero; else the run is refused."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BenchmarkRefused(f"{what} is {value!r}: a time or rate must be positive and finite")
    return float(value)


def decode_run(
    requests: Sequence[RequestTiming], expected_tokens: int, wall_s: float, what: str
) -> DecodeRun:
    """Checks one timed generate() and reduces it to a DecodeRun.

    Refused: fewer or more tokens than asked (ignore_eos was set), a preempted request (its
    recompute is not decode), a first token at or after the last, a decode span longer than
    generate() itself, or tokens/s that disagrees with batch / TPOT by more than
    TOKENS_PER_S_TOLERANCE (the requests did not decode as one batch)."""
    if not requests:
        raise BenchmarkRefused(f"{what}: no requests came back")
    if expected_tokens < 2:
        raise BenchmarkRefused(f"{what}: TPOT needs at least 2 output tokens per request")
    wall_s = positive(wall_s, f"{what}: wall time of generate()")
    per_request = []
    for i, r in enumerate(requests):
        if r.output_tokens != expected_tokens:
            raise BenchmarkRefused(
                f"{what}: request {i} generated {r.output_tokens} of {expected_tokens} tokens"
            )
        if r.preemptions:
            raise BenchmarkRefused(f"{what}: request {i} was preempted {r.preemptions} time(s)")
        span = r.last_token_s - r.first_token_s
        per_request.append(
            positive(span / (expected_tokens - 1), f"{what}: request {i}'s TPOT (s)")
        )
    tpot_s = positive(statistics.median(per_request), f"{what}: TPOT (s)")
    decode_span_s = positive(
        max(r.last_token_s for r in requests) - min(r.first_token_s for r in requests),
        f"{what}: decode span (s)",
    )
    if decode_span_s > wall_s * (1 + WALL_TOLERANCE):
        raise BenchmarkRefused(
            f"{what}: decode span {decode_span_s:.4f} s is longer than generate() took "
            f"({wall_s:.4f} s): the timestamps are not from this run"
        )
    batch = len(requests)
    tokens_per_s = batch * (expected_tokens - 1) / decode_span_s
    implied = batch / tpot_s
    if abs(tokens_per_s / implied - 1) > TOKENS_PER_S_TOLERANCE:
        raise NotDecodedTogether(
            f"{what}: decode tokens/s {tokens_per_s:.1f} disagrees with batch / TPOT "
            f"{implied:.1f} by more than {TOKENS_PER_S_TOLERANCE:.0%}: the {batch} requests "
            "did not decode together"
        )
    return DecodeRun(tpot_s, tokens_per_s, decode_span_s, wall_s, batch)


class NotDecodedTogether(BenchmarkRefused):
    """One timed run whose requests did not decode as one batch (decode_run): a sample that
    is not a batch's TPOT; a runner may take that repeat again and say so."""


def bounded_spread(values: Sequence[float], bound: float, what: str) -> Spread:
    """The spread of `values` (each checked positive), refused when wider than `bound`."""
    for i, v in enumerate(values):
        positive(v, f"{what}, repeat {i}")
    spread = Spread.of(values)
    if spread.relative > bound:
        shown = ", ".join(f"{v:.4g}" for v in values)
        raise BenchmarkRefused(
            f"{what}: spread (max - min) / median = {spread.relative:.2f} over [{shown}] is "
            f"wider than the bound {bound:.2f}"
        )
    return spread


def ratio(numerator: Spread, denominator: Spread) -> Ratio:
    """numerator / denominator from the medians; the range pairs the extremes."""
    return Ratio(
        numerator.median / denominator.median,
        numerator.low / denominator.high,
        numerator.high / denominator.low,
    )


def added_per_layer_us(afd_ms: Spread, colocated_ms: Spread, layers: int) -> Ratio:
    """(TPOT_afd - TPOT_colocated) / layers in µs, from the medians, with its range."""
    scale = 1000.0 / layers
    return Ratio(
        (afd_ms.median - colocated_ms.median) * scale,
        (afd_ms.low - colocated_ms.high) * scale,
        (afd_ms.high - colocated_ms.low) * scale,
    )


def late_events(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Counters that grew between two snapshots (compiles, graph captures)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}


def refuse_late_events(events: Mapping[str, int], what: str, kernels: Sequence[str] = ()) -> None:
    """Refuses a timed run in which something compiled or captured; `kernels`: the Triton
    kernels compiled meanwhile, by name."""
    if events:
        shown = ", ".join(f"{k} +{v}" for k, v in sorted(events.items()))
        named = f"; Triton kernels compiled: {', '.join(kernels)}" if kernels else ""
        raise BenchmarkRefused(
            f"{what}: compiles or graph captures inside the timed region ({shown}{named}); "
            "warm-up did not cover every shape"
        )


# `vllm bench serve` figures that must be positive, and the median/p99 pairs that must be ordered.
SERVE_POSITIVE = (
    "duration", "request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms",
    "median_itl_ms", "mean_e2el_ms",
)  # fmt: skip
SERVE_ORDERED = ("ttft", "tpot", "itl")


def check_serve_run(
    result: Mapping[str, float], num_prompts: int, output_len: int, concurrency: int, what: str
) -> None:
    """Refuses one `vllm bench serve` result that cannot be right: requests not all completed,
    a time or rate that is not positive, fewer output tokens than asked (--ignore-eos), an
    output throughput that disagrees with its own token count and duration, a median above its
    p99, or more output tokens/s than `concurrency` requests in flight can give at the measured
    mean end-to-end latency (plus TOKENS_PER_S_TOLERANCE)."""
    if result.get("completed") != num_prompts:
        raise BenchmarkRefused(
            f"{what}: {result.get('completed')} of {num_prompts} requests completed"
        )
    for key in SERVE_POSITIVE:
        positive(result.get(key, math.nan), f"{what}: {key}")
    total = result.get("total_output_tokens")
    if total is not None:
        if total != num_prompts * output_len:
            raise BenchmarkRefused(
                f"{what}: {total} output tokens, {num_prompts} x {output_len} asked"
            )
        measured = total / result["duration"]
        if abs(result["output_throughput"] / measured - 1) > 0.02:
            raise BenchmarkRefused(
                f"{what}: output_throughput {result['output_throughput']:.1f} disagrees with "
                f"{total} tokens in {result['duration']:.2f} s"
            )
    for name in SERVE_ORDERED:
        median, p99 = result.get(f"median_{name}_ms"), result.get(f"p99_{name}_ms")
        if median is not None and p99 is not None and median > p99:
            raise BenchmarkRefused(f"{what}: median {name} {median} ms above its p99 {p99} ms")
    ceiling = concurrency * output_len * 1e3 / result["mean_e2el_ms"]
    if result["output_throughput"] > ceiling * (1 + TOKENS_PER_S_TOLERANCE):
        raise BenchmarkRefused(
            f"{what}: {result['output_throughput']:.1f} output tokens/s is more than "
            f"{concurrency} requests in flight give at a mean latency of "
            f"{result['mean_e2el_ms']:.1f} ms ({ceiling:.1f})"
        )
