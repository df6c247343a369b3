"""Robust statistics for `afd-ctl advise` (issue 38): medians, a weighted median and a
deterministic Theil-Sen line over groups of steps of equal size. A real pair's window holds
compile steps and stalls of the machine; none of these moves for a few of them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MAX_GROUPS = 64
# A step size counts for the FFN's line when at least this share of its steps have it.
MIN_GROUP_SHARE = 0.01


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The value at half the total weight of (value, weight) pairs."""
    ordered = sorted(pairs)
    half = sum(w for _, w in ordered) / 2
    seen = 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0] if ordered else 0.0


def groups_of(points: Sequence[tuple[float, float]]) -> list[tuple[float, float, int]]:
    """(x, median y, count) per distinct x, or per one of MAX_GROUPS bins of equal count when
    x takes more values than that."""
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(x, []).append(y)
    if len(by_x) <= MAX_GROUPS:
        return [(x, median(ys), len(ys)) for x, ys in sorted(by_x.items())]
    ordered = sorted(points)
    size = -(-len(ordered) // MAX_GROUPS)
    chunks = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    return [(median([x for x, _ in c]), median([y for _, y in c]), len(c)) for c in chunks]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float, bool]:
    """Theil-Sen y = c0 + c1*x over groups of equal x: c1 the median of the slopes between
    every two groups that hold at least MIN_GROUP_SHARE of the points (5 at least), each slope
    weighted by the pairs of steps it stands for (0 when that is negative); c0 the median of
    y - c1*x; (c0, c1, whether x varied enough to fit c0). Otherwise (one size of step, or a
    negative c0) y = c1*x through the medians."""
    xs = [x for x, _ in points]
    mx, my = median(xs), median([y for _, y in points])
    if mx <= 0:
        return my, 0.0, False
    least = max(5.0, MIN_GROUP_SHARE * len(points))
    groups = [g for g in groups_of(points) if g[2] >= least]
    slopes = [
        ((y2 - y1) / (x2 - x1), n1 * n2)
        for i, (x1, y1, n1) in enumerate(groups)
        for x2, y2, n2 in groups[i + 1 :]
        if x2 - x1 > 0.05 * mx  # steps of nearly the same size say nothing of a slope
    ]
    if not slopes:
        return 0.0, my / mx, False
    # Compute that does not grow with the step's size: flat (c1 = 0), so no ratio makes the
    # FFN side the bottleneck (A* infinite), which a proportional line would turn around.
    c1 = max(0.0, weighted_median(slopes))
    c0 = median([y - c1 * x for x, y in points])
    if c0 < 0:  # steps cost more than their size explains: proportional is the closer line
        return 0.0, my / mx, False
    return c0, c1, True
