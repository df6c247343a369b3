"""Interleaved timing of engines that run at once, and the intervals of what is compared.

On a shared GPU (or a loaded CPU machine) a part measured minutes after another one sees other
conditions, and a spread bound then refuses runs that are only noisy. Here every part's engine
is up at the same time (benchmarks/decode_runner.py --lockstep), and the driver runs their
timed repeats in turn at each batch size: A, B, then B, A at the next repeat, so drift and
order hit both alike. What is compared comes with an interval instead of a refusal:

- `ratio_interval`: the ratio of two parts' median TPOT with a 95% bootstrap interval (each
  part's repeats resampled);
- `layer_fit`: what AFD adds per step and per layer, from the added TPOT at two depths or more (least squares)
  (added(L) = a + b * L), each with its bootstrap interval;
- `calls_ratio_interval` and `calls_layer_fit`: the same over several calls (each its own
  engine starts), the mean of the calls' figures: where a start lands moves a call's figure by
  more than its repeats show (2026-12-07 H100: two 4-layer calls' ratios 1.013 and 1.023, each
  interval 0.003 wide). The interval is the wider of a Student t interval over the calls'
  figures (their spread, n - 1 degrees of freedom: with two calls t is 12.7, as wide as two
  calls honestly allow) and a bootstrap that resamples the calls, then their repeats (which
  alone covers the mean of few calls far less often than 95%: it returns about their range).

A run is refused only for nonsense (non-positive figures, mismatched counts, late compiles:
decode_runner refuses those) or when an interval is wider than the bound the caller states.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.timing_stats import BenchmarkRefused
from vllm_ext.testing.processes import Proc

BOOTSTRAP = 2000
CONFIDENCE = 0.95


class Lockstep:
    """A decode_runner started with --lockstep (stdin_pipe=True), driven one repeat at a time."""

    def __init__(self, name: str, proc: Proc) -> None:
        self.name = name
        self.proc = proc
        self._answers = 0

    def _lines(self, key: str) -> list[dict[str, Any]]:
        found = []
        for line in self.proc.log().splitlines():
            if line.startswith("{") and f'"{key}"' in line:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
        return found

    def _wait(self, key: str, count: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self._lines(key)
            if len(lines) >= count:
                return lines[count - 1]
            refused = self._lines("refused")
            if refused:
                raise BenchmarkRefused(f"{self.name}: {refused[-1]['refused']}")
            if self.proc.popen.poll() is not None:
                raise BenchmarkRefused(f"{self.name} exited: {self.proc.tail(15)}")
            if time.monotonic() > deadline:
                raise BenchmarkRefused(f"{self.name}: no {key!r} within {timeout_s:.0f} s")
            time.sleep(0.05)

    def ready(self, timeout_s: float) -> None:
        self._wait("ready", 1, timeout_s)

    def run(self, batch: int, repeat: int, timeout_s: float) -> float:
        """One timed repeat; its TPOT in ms."""
        self.proc.send(json.dumps({"batch": batch, "repeat": repeat}))
        self._answers += 1
        return float(self._wait("run", self._answers, timeout_s)["run"]["tpot_ms"])

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """Ends the loop; the runner's report."""
        self.proc.send(json.dumps({"done": True}))
        return self._wait("batches", 1, timeout_s)  # the report (decode_runner's last line)


class Part(Protocol):
    """What `interleave` drives: a Lockstep (or anything that runs one timed repeat)."""

    name: str

    def run(self, batch: int, repeat: int, timeout_s: float) -> float: ...


def interleave(
    parts: Sequence[Part],
    batches: Sequence[int],
    repeats: int,
    timeout_s: float,
    more: More | None = None,
) -> dict[str, dict[int, list[float]]]:
    """Every part's TPOT (ms) per batch and repeat, the parts taking turns (A, B, then B, A).

    `more`: after the `repeats`, further rounds of only the batch sizes whose intervals are
    still too wide (More.wide), in turn as before, until none is or More's bounds pass."""
    tpot: dict[str, dict[int, list[float]]] = {p.name: {b: [] for b in batches} for p in parts}

    def one_round(r: int, todo: Sequence[int]) -> None:
        order = list(parts) if r % 2 == 0 else list(reversed(parts))
        for b in todo:
            for part in order:
                tpot[part.name][b].append(part.run(b, r, timeout_s))

    for r in range(repeats):
        one_round(r, batches)
    if more is not None:
        deadline = time.monotonic() + more.budget_s
        r = repeats
        while r < more.max_repeats and time.monotonic() < deadline and (todo := more.wide(tpot)):
            one_round(r, todo)
            r += 1
    return tpot


@dataclass(frozen=True)
class More:
    """Repeats past the first ones where a ratio's interval is wider than `bound` (relative):
    up to `max_repeats` in all per batch size, no new round `budget_s` after the extra ones
    began (a noisy batch size gets the repeats a quiet one does not need)."""

    bound: float
    max_repeats: int
    budget_s: float

    def wide(self, tpot: dict[str, dict[int, list[float]]]) -> list[int]:
        """The batch sizes where some later part / earlier part interval is wider than bound."""
        names = list(tpot)
        batches = list(tpot[names[0]]) if names else []
        return [
            b
            for b in batches
            if any(
                ratio_interval(tpot[later][b], tpot[earlier][b]).relative_width > self.bound
                for i, earlier in enumerate(names)
                for later in names[i + 1 :]
            )
        ]


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    @property
    def relative_width(self) -> float:
        return (self.high - self.low) / abs(self.value) if self.value else float("inf")

    def as_list(self, digits: int = 3) -> list[float]:
        return [round(self.low, digits), round(self.high, digits)]


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    tail = (1 - CONFIDENCE) / 2
    return ordered[int(tail * len(ordered))], ordered[int((1 - tail) * len(ordered)) - 1]


def ratio_interval(num: Sequence[float], den: Sequence[float], seed: int = 0) -> Interval:
    """median(num) / median(den) with a bootstrap interval (both resampled)."""
    rng = random.Random(seed)
    value = statistics.median(num) / statistics.median(den)
    samples = [
        statistics.median(rng.choices(num, k=len(num)))
        / statistics.median(rng.choices(den, k=len(den)))
        for _ in range(BOOTSTRAP)
    ]
    return Interval(value, *_percentiles(samples))


# Student t's 97.5% quantile by degrees of freedom (1-30; beyond, 30's: a little wide).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    return _T975[min(df, len(_T975)) - 1]


def _widest(value: float, *intervals: tuple[float, float]) -> Interval:
    return Interval(value, min(lo for lo, _ in intervals), max(hi for _, hi in intervals))


def _ratio(num: Sequence[float], den: Sequence[float]) -> float:
    return statistics.median(num) / statistics.median(den)


Call = tuple[Sequence[float], Sequence[float]]  # one call's repeats: (numerator, denominator)


def _resample(rng: random.Random, xs: Sequence[float]) -> list[float]:
    return rng.choices(list(xs), k=len(xs))


def calls_ratio_interval(calls: Sequence[Call], seed: int = 0) -> Interval:
    """The mean over calls of each call's median(num) / median(den); its interval the wider of
    a t interval over the calls' ratios and a bootstrap resampling the calls, then each picked
    call's repeats. One call: `ratio_interval`."""
    if len(calls) == 1:
        return ratio_interval(*calls[0], seed=seed)
    rng = random.Random(seed)
    ratios = [_ratio(num, den) for num, den in calls]
    value = statistics.fmean(ratios)
    half = t975(len(ratios) - 1) * statistics.stdev(ratios) / len(ratios) ** 0.5
    samples = [
        statistics.fmean(
            _ratio(_resample(rng, num), _resample(rng, den))
            for num, den in rng.choices(list(calls), k=len(calls))
        )
        for _ in range(BOOTSTRAP)
    ]
    return _widest(value, _percentiles(samples), (value - half, value + half))


def calls_layer_fit(calls: dict[int, Sequence[Call]], seed: int = 0) -> tuple[Interval, Interval]:
    """`layer_fit` where a depth has several calls, each `(afd repeats, colocated repeats)`:
    added(L) is the mean of its calls' added TPOT. Each interval is the wider of a t interval
    (the calls' spread about their depth's mean, pooled over the depths) and a bootstrap
    resampling each depth's calls, then their repeats. One call per depth: `layer_fit`."""
    if all(len(c) == 1 for c in calls.values()):
        return layer_fit(
            {d: c[0][0] for d, c in calls.items()}, {d: c[0][1] for d, c in calls.items()}, seed
        )
    depths = sorted(calls)
    if len(depths) < 2:
        raise BenchmarkRefused(f"the layer fit needs two depths or more, got {depths}")
    rng = random.Random(seed)

    def added(picked: dict[int, Sequence[Call]], pick: Any) -> dict[int, float]:
        return {
            d: statistics.fmean(1e3 * (pick(afd) - pick(colo)) for afd, colo in picked[d])
            for d in depths
        }

    step, layer = _line(added(calls, statistics.median))
    t_step, t_layer = _line_t_halves(
        {
            d: [1e3 * (statistics.median(a) - statistics.median(c)) for a, c in calls[d]]
            for d in depths
        }
    )
    boots = [
        _line(
            added(
                {d: rng.choices(list(calls[d]), k=len(calls[d])) for d in depths},
                lambda xs: statistics.median(_resample(rng, xs)),
            )
        )
        for _ in range(BOOTSTRAP)
    ]
    return (
        _widest(step, _percentiles([b[0] for b in boots]), (step - t_step, step + t_step)),
        _widest(layer, _percentiles([b[1] for b in boots]), (layer - t_layer, layer + t_layer)),
    )


def _line_t_halves(added: dict[int, list[float]]) -> tuple[float, float]:
    """The t intervals' half-widths of `_line`'s (intercept, slope) through the depths' mean
    added time, from the calls' variance about their depth's mean (pooled over the depths)."""
    depths = sorted(added)
    df = sum(len(added[d]) - 1 for d in depths)
    sq = sum((x - statistics.fmean(added[d])) ** 2 for d in depths for x in added[d])
    var = sq / df
    mean_depth = sum(depths) / len(depths)
    spread = sum((L - mean_depth) ** 2 for L in depths)
    slope_w = {L: (L - mean_depth) / spread for L in depths}
    step_w = {L: 1 / len(depths) - mean_depth * slope_w[L] for L in depths}
    t = t975(df)

    def half(w: dict[int, float]) -> float:
        return t * (var * sum(w[L] ** 2 / len(added[L]) for L in depths)) ** 0.5

    return half(step_w), half(slope_w)


def _line(added: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through added(L)."""
    depths = sorted(added)
    mean_depth = sum(depths) / len(depths)
    spread = sum((L - mean_depth) ** 2 for L in depths)
    mean_added = sum(added.values()) / len(depths)
    per_layer = sum((L - mean_depth) * (added[L] - mean_added) for L in depths) / spread
    return mean_added - per_layer * mean_depth, per_layer


def layer_fit(
    afd: dict[int, Sequence[float]], colocated: dict[int, Sequence[float]], seed: int = 0
) -> tuple[Interval, Interval]:
    """(added per step, added per layer), µs, from two or more depths: added(L) = median
    TPOT_afd(L) - median TPOT_colocated(L) = per_step + per_layer * L (TPOTs in ms), a
    least-squares line through the depths (through both points with two)."""
    depths = sorted(afd)
    if len(depths) < 2 or sorted(colocated) != depths:
        raise BenchmarkRefused(
            f"the layer fit needs two depths or more in both parts, got {depths}"
        )
    rng = random.Random(seed)

    def fit(pick: Any) -> tuple[float, float]:
        return _line({L: 1e3 * (pick(afd[L]) - pick(colocated[L])) for L in depths})

    step, layer = fit(statistics.median)
    boots = [
        fit(lambda xs: statistics.median(rng.choices(list(xs), k=len(xs))))
        for _ in range(BOOTSTRAP)
    ]
    return (
        Interval(step, *_percentiles([b[0] for b in boots])),
        Interval(layer, *_percentiles([b[1] for b in boots])),
    )


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts one MoE layer reads per step when each token picks `top_k` of
    `experts` uniformly at random (vLLM's uniform_random routing simulation)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)
