"""`afd-ctl advise` (issue 26): the bottleneck side and the attention:FFN ratio that balances
them, from the workers' rolling windows. Pure: a `Timings` in, an `Advice` out.

The model (MegaScale-Infer's ping-pong balance): with M attention and N FFN workers, A = M/N,
each attention worker runs a batch of b tokens per step, so each FFN worker takes A*b. Per
layer, attention takes T_a(b) and the FFN T_f(A*b). With two or more micro-batches in
ping-pong the exchange hides behind compute, and a layer costs max(T_a(b), T_f(A*b)); the
sides balance when T_a(b) = T_f(A*b). T_f is fitted as c0 + c1*B over the FFN's per-step
points (tokens, compute); when B barely varies the fit cannot tell c0 from c1 and c0 is taken
as 0 (said in the advice). Then

    A* = (T_a(b) - c0) / (c1 * b)
    tokens/s per GPU at A:1 = A*b / (L * max(T_a(b), c0 + c1*A*b) * (A + 1))

Issue 38: the statistics are robust, because a real pair's steps are not a lab's: T_a and b are
medians, the FFN line a Theil-Sen fit (the median of the slopes between steps of different sizes), so
a compile step or a hiccup of the machine moves nothing. Warm-up, profile and capture steps
never reach the window (the daemon counts them apart). A noisy window gets an answer with its
interval: A* recomputed over resamples of the window's reports (a bootstrap), 5th to 95th
percentile, instead of a refusal; so does a short window (resampling its steps), with a note
that says so. Advice is refused only without data or on nonsense: a side that does not report
or has no serving step yet, no tokens, no compute time.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from afd_ctl.robust_fit import fit_line
from afd_ctl.robust_fit import median as _median
from afd_ctl.v1 import afd_pb2

MIN_STEPS = 50
MIN_REPORTS = 3
# A relative spread (attention's robust coefficient of variation, or the FFN's median distance
# from its fit) above which the advice says the window is noisy and how far to trust it.
MAX_NOISE = 0.25
CANDIDATES = (1, 2, 3, 4, 6, 8)
RESAMPLES = 100
Point = tuple[float, float, float]  # tokens, compute s, wait s of one step


class AdviceRefused(Exception):
    """The window cannot support advice; the message says why and what to do."""


@dataclass
class Candidate:
    attention: int
    ffn: int
    layer_ms: float
    bottleneck: str
    tokens_per_s_per_gpu: float


@dataclass
class Advice:
    bottleneck: str
    why: str
    formula: str
    inputs: dict[str, float]
    balanced_ratio: float
    recommended: str
    candidates: list[Candidate]
    assumptions: list[str]
    notes: list[str] = field(default_factory=list)
    # A* over resamples of the window's reports: 5th and 95th percentile (widened to A* itself
    # when that lies outside).
    balanced_ratio_interval: tuple[float, float] = (math.nan, math.nan)
    noisy: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _report_points(r: afd_pb2.StepTimings) -> list[Point]:
    """(tokens, compute s, wait s) per step where the report carries per-step entries, else
    its means as one point."""
    n = len(r.step_compute_s)
    if n and len(r.step_tokens) == n and len(r.step_wait_s) == n:
        return [
            (float(x), float(c), float(w))
            for x, c, w in zip(r.step_tokens, r.step_compute_s, r.step_wait_s, strict=True)
        ]
    if r.steps:
        return [(r.tokens / r.steps, r.compute_s / r.steps, r.wait_s / r.steps)]
    return []


def _reports(workers: list[afd_pb2.WorkerTimings]) -> list[list[Point]]:
    return [points for w in workers for r in w.window if (points := _report_points(r))]


def _check(side: str, workers: list[afd_pb2.WorkerTimings]) -> str:
    """Refuses a side with no serving steps; '' when its window is long enough, else what it
    holds (a short window is answered, as noisy)."""
    if not workers:
        raise AdviceRefused(
            f"no {side} worker reports step timings: advice needs both sides (workers report "
            "through ControllerClient.timings; an older worker does not)"
        )
    steps = sum(r.steps for w in workers for r in w.window)
    reports = sum(len(w.window) for w in workers)
    if steps == 0:
        raise AdviceRefused(
            f"the {side} workers have reported no serving steps yet (warm-up steps do not "
            "count): send requests for a few seconds and ask again"
        )
    if steps < MIN_STEPS or reports < MIN_REPORTS:
        return f"{steps} {side} steps in {reports} report{'s' * (reports != 1)}"
    return ""


def _steps(reports: list[list[Point]]) -> list[list[Point]]:
    return [[p] for r in reports for p in r]


@dataclass
class Estimate:
    t_a_step: float  # median attention compute per step, s
    b: float  # median tokens per attention step
    c0_step: float
    c1_step: float
    fitted: bool
    ffn_tokens: float

    def balanced(self, layers: int) -> float:
        return balanced_ratio(
            self.t_a_step / layers, self.c0_step / layers, self.c1_step / layers, self.b
        )


def balanced_ratio(t_a: float, c0: float, c1: float, b: float) -> float:
    """A* = (T_a - c0) / (c1*b); 0 when the FFN's fixed cost alone is at or above T_a (the FFN
    side limits at every ratio: no A balances it), infinite when the FFN does not grow with
    tokens (c1 = 0) and stays below T_a."""
    if c0 >= t_a:
        return 0.0
    return (t_a - c0) / (c1 * b) if c1 > 0 and b > 0 else math.inf


def _estimate(attention: list[list[Point]], ffn: list[list[Point]]) -> Estimate:
    a_points = [p for r in attention for p in r]
    f_points = [p for r in ffn for p in r]
    c0, c1, fitted = fit_line([(x, y) for x, y, _ in f_points])
    return Estimate(
        t_a_step=_median([c for _, c, _ in a_points]),
        b=_median([x for x, _, _ in a_points]),
        c0_step=c0,
        c1_step=c1,
        fitted=fitted,
        ffn_tokens=_median([x for x, _, _ in f_points]),
    )


def _interval(
    attention: list[list[Point]], ffn: list[list[Point]], layers: int, rng: random.Random
) -> tuple[float, float]:
    """A* over RESAMPLES resamples (with replacement) of each side's reports: 5th, 95th
    percentile."""
    values = []
    for _ in range(RESAMPLES):
        a = [attention[rng.randrange(len(attention))] for _ in attention]
        f = [ffn[rng.randrange(len(ffn))] for _ in ffn]
        values.append(_estimate(a, f).balanced(layers))  # infinite: the FFN never limits
    values.sort()
    return values[int(0.05 * (RESAMPLES - 1))], values[int(0.95 * (RESAMPLES - 1))]


def advise(timings: afd_pb2.Timings) -> Advice:
    attention = [w for w in timings.workers if w.load.role == afd_pb2.ATTENTION]
    ffn = [w for w in timings.workers if w.load.role == afd_pb2.FFN]
    short = [x for x in (_check("attention", attention), _check("FFN", ffn)) if x]
    layers = max(w.load.layers for w in timings.workers) or 1
    a_reports, f_reports = _reports(attention), _reports(ffn)
    rng = random.Random(0)  # the same window gives the same advice
    est = _estimate(a_reports, f_reports)
    if est.b <= 0:
        raise AdviceRefused("the attention workers report 0 tokens per step: no traffic yet")
    if est.t_a_step <= 0 or _median([y for r in f_reports for _, y, _ in r]) <= 0:
        raise AdviceRefused(
            "a side reports no compute time (0 ms per step): its reporter measures nothing; "
            "check that it calls timings.step(compute_s=...) with the step's compute"
        )
    a_compute = [c for r in a_reports for _, c, _ in r]
    a_noise = 1.4826 * _median([abs(c - est.t_a_step) for c in a_compute]) / est.t_a_step
    f_points = [p for r in f_reports for p in r]
    f_mean = _median([y for _, y, _ in f_points])
    f_residual = _median([abs(y - (est.c0_step + est.c1_step * x)) for x, y, _ in f_points])
    f_noise = f_residual / f_mean if f_mean > 0 else math.inf
    # A short window has too few reports to resample: its steps are resampled instead.
    units = (_steps(a_reports), _steps(f_reports)) if short else (a_reports, f_reports)
    lo, hi = _interval(*units, layers, rng)
    # A lopsided spread of resamples can leave the window's own estimate outside their 90%:
    # the interval then reaches out to it.
    a_star = est.balanced(layers)
    interval = (min(lo, a_star), max(hi, a_star))
    b, fitted, ffn_tokens = est.b, est.fitted, est.ffn_tokens
    t_a = est.t_a_step / layers  # per layer, seconds
    c0, c1 = est.c0_step / layers, est.c1_step / layers
    m, n = len(attention), len(ffn)
    a_now = m / n
    t_f_now = c0 + c1 * a_now * b
    a_wait = sum(r.wait_s for w in attention for r in w.window) / max(
        1e-12, sum(r.busy_wall_s for w in attention for r in w.window)
    )
    f_wait = sum(r.wait_s for w in ffn for r in w.window) / max(
        1e-12, sum(r.busy_wall_s for w in ffn for r in w.window)
    )
    bottleneck = "ffn" if t_f_now > t_a else "attention"
    why = (
        f"per layer at {m}:{n}, T_f(A*b) = {1e3 * t_f_now:.3f} ms "
        f"{'>' if bottleneck == 'ffn' else '<='} T_a(b) = {1e3 * t_a:.3f} ms; attention waits "
        f"{a_wait:.0%} of its busy time, the FFN side {f_wait:.0%}"
    )
    balanced = balanced_ratio(t_a, c0, c1, b)
    notes: list[str] = []
    lo, hi = interval
    wide = not math.isfinite(hi) or hi - lo > 0.5 * max(balanced, 1.0)
    noisy = a_noise > MAX_NOISE or f_noise > MAX_NOISE or wide or bool(short)
    if short:
        notes.append(
            f"short window: {' and '.join(short)} (firm advice takes {MIN_STEPS} serving steps "
            f"in {MIN_REPORTS} reports a side); A* lies in [{lo:.2f}, {hi:.2f}] over resamples "
            "of its steps (90%): ask again after a few seconds of traffic"
        )
    elif noisy:
        notes.append(
            f"noisy window: attention compute varies by {a_noise:.0%} from step to step "
            f"(robust), FFN compute strays {f_noise:.0%} from its fit; A* lies in "
            f"[{lo:.2f}, {hi:.2f}] over resamples of the window's reports (90%): trust the "
            "ratio that far, or ask again after steadier traffic"
        )
    if not fitted:
        notes.append(
            "tokens per step barely varied on the FFN side (or the fit was not a line): "
            "T_f taken as proportional to tokens (c0 = 0)"
        )
    if ffn_tokens > 0 and abs(ffn_tokens - a_now * b) > 0.2 * a_now * b:
        notes.append(
            f"each FFN worker reports {ffn_tokens:.1f} tokens per step, not A*b = "
            f"{a_now * b:.1f}: routing or batch sizes differ between workers"
        )
    wanted = set(CANDIDATES)
    if math.isfinite(balanced) and balanced >= 1:
        wanted |= {max(1, math.floor(balanced)), math.ceil(balanced)}
    candidates = []
    for a in sorted(wanted):
        t_f = c0 + c1 * a * b
        layer = max(t_a, t_f)
        candidates.append(
            Candidate(
                attention=a,
                ffn=1,
                layer_ms=1e3 * layer,
                bottleneck="ffn" if t_f > t_a else "attention",
                tokens_per_s_per_gpu=a * b / (layers * layer * (a + 1)),
            )
        )
    best = max(candidates, key=lambda c: c.tokens_per_s_per_gpu)
    if math.isinf(balanced):
        notes.append(
            "FFN compute does not grow with tokens per step over the sizes in the window "
            "(c1 = 0): no attention:FFN ratio makes the FFN side the bottleneck in this model "
            "(A* is infinite; the candidates show where attention keeps it)"
        )
    if balanced == 0:
        notes.append(
            f"the FFN's fixed cost alone (c0 = {1e3 * c0:.3f} ms a layer) is at or above "
            f"attention's T_a(b) = {1e3 * t_a:.3f} ms: the FFN side limits at every ratio, and "
            "more FFN than attention workers lies outside this model (A* = 0)"
        )
    elif balanced < 1:
        notes.append(
            f"A* = {balanced:.2f} < 1: the FFN side is slower than attention even at 1:1; "
            "more FFN than attention workers lies outside this model (FFN time per worker would "
            "depend on how experts are split)"
        )
    return Advice(
        bottleneck=bottleneck,
        why=why,
        formula="T_a(b) = T_f(A*b), T_f(B) = c0 + c1*B  =>  A* = (T_a(b) - c0) / (c1*b); "
        "tokens/s/GPU(A:1) = A*b / (L * max(T_a(b), T_f(A*b)) * (A+1))",
        inputs={
            "M_attention_workers": m,
            "N_ffn_workers": n,
            "A_now": a_now,
            "b_tokens_per_attention_step": b,
            "L_layers": layers,
            "T_a_ms_per_layer": 1e3 * t_a,
            "c0_ms_per_layer": 1e3 * c0,
            "c1_us_per_token_per_layer": 1e6 * c1,
            "T_f_now_ms_per_layer": 1e3 * t_f_now,
            "attention_waiting_share": a_wait,
            "ffn_waiting_share": f_wait,
            "attention_steps": sum(r.steps for w in attention for r in w.window),
            "ffn_steps": sum(r.steps for w in ffn for r in w.window),
            "attention_noise": a_noise,
            "ffn_noise": f_noise,
        },
        balanced_ratio_interval=interval,
        noisy=noisy,
        balanced_ratio=balanced,
        recommended=f"{best.attention}:{best.ffn}",
        candidates=candidates,
        assumptions=[
            "each attention worker keeps its batch b whatever the ratio (its KV cache bounds "
            "it); each FFN worker serves A*b tokens per step",
            "ping-pong with two or more micro-batches hides the exchange: a layer costs "
            "max(T_a, T_f); at A:1 the faster side idles the rest",
            "T_f is linear in tokens per step (fitted over the window); T_a is measured at b; "
            "both are medians of serving steps (warm-up, profile and capture steps left out)",
            "one GPU per worker; tokens/s per GPU counts attention and FFN GPUs alike",
        ],
        notes=notes,
    )
