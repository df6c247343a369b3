"""`afd-ctl advise` (issue 26): the bottleneck side and the attention:FFN ratio that balances
them, from the workers' rolling windows. Pure: a `Timings` in, an `Advice` out.

The model (MegaScale-Infer's ping-pong balance): with M attention and N FFN workers, A = M/N,
each attention worker runs a batch of b tokens per step, so each FFN worker takes A*b. Per
layer, attention takes T_a(b) and the FFN T_f(A*b). With two or more micro-batches in
ping-pong the exchange hides behind compute, and a layer costs max(T_a(b), T_f(A*b)); the
sides balance when T_a(b) = T_f(A*b). T_f is fitted as c0 + c1*B over the FFN reports (each
report is one point: tokens per step, compute per step); when B barely varies the fit cannot
tell c0 from c1 and c0 is taken as 0 (said in the advice). Then

    A* = (T_a(b) - c0) / (c1 * b)
    tokens/s per GPU at A:1 = A*b / (L * max(T_a(b), c0 + c1*A*b) * (A + 1))
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from afd_ctl.v1 import afd_pb2

MIN_STEPS = 50
MIN_REPORTS = 3
# Relative spread (coefficient of variation, or the FFN fit's relative residual) above which
# the window is too noisy to advise from.
MAX_NOISE = 0.25
CANDIDATES = (1, 2, 3, 4, 6, 8)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _points(workers: list[afd_pb2.WorkerTimings]) -> list[tuple[float, float, float]]:
    """(tokens, compute s, wait s) per step where the reports carry per-step entries, else
    per-report means."""
    points: list[tuple[float, float, float]] = []
    for w in workers:
        for r in w.window:
            n = len(r.step_compute_s)
            if n and len(r.step_tokens) == n and len(r.step_wait_s) == n:
                points += zip(r.step_tokens, r.step_compute_s, r.step_wait_s, strict=True)
            elif r.steps:
                points.append((r.tokens / r.steps, r.compute_s / r.steps, r.wait_s / r.steps))
    return [(float(x), float(c), float(wt)) for x, c, wt in points]


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else math.inf


def _check(side: str, workers: list[afd_pb2.WorkerTimings]) -> None:
    if not workers:
        raise AdviceRefused(
            f"no {side} worker reports step timings: advice needs both sides (workers report "
            "through ControllerClient.timings; an older worker does not)"
        )
    steps = sum(r.steps for w in workers for r in w.window)
    reports = sum(len(w.window) for w in workers)
    if steps < MIN_STEPS or reports < MIN_REPORTS:
        raise AdviceRefused(
            f"the {side} window is too short: {steps} steps in {reports} reports; need at "
            f"least {MIN_STEPS} steps in {MIN_REPORTS} reports (run traffic for a few seconds "
            "and ask again)"
        )


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float, bool]:
    """Least squares y = c0 + c1*x; (c0, c1, whether x varied enough to fit c0)."""
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if mx <= 0:
        return my, 0.0, False
    if sxx <= (0.05 * mx) ** 2 * len(xs):  # tokens per step spread under 5%: proportional
        return 0.0, my / mx, False
    c1 = sum((x - mx) * (y - my) for x, y in points) / sxx
    c0 = my - c1 * mx
    if c0 < 0 or c1 <= 0:  # a line through noise; fall back to proportional
        return 0.0, my / mx, False
    return c0, c1, True


def advise(timings: afd_pb2.Timings) -> Advice:
    attention = [w for w in timings.workers if w.load.role == afd_pb2.ATTENTION]
    ffn = [w for w in timings.workers if w.load.role == afd_pb2.FFN]
    _check("attention", attention)
    _check("FFN", ffn)
    layers = max(w.load.layers for w in timings.workers) or 1
    a_points = _points(attention)
    f_points = _points(ffn)
    a_noise = _cv([c for _, c, _ in a_points])
    if a_noise > MAX_NOISE:
        raise AdviceRefused(
            f"the attention window is too noisy: attention compute varies by {a_noise:.0%} "
            f"from step to step (coefficient of variation), above {MAX_NOISE:.0%}; "
            "wait for steadier traffic and ask again"
        )
    c0_step, c1_step, fitted = fit_line([(x, y) for x, y, _ in f_points])
    residual = [abs(y - (c0_step + c1_step * x)) for x, y, _ in f_points]
    f_mean = statistics.fmean([y for _, y, _ in f_points])
    f_noise = statistics.fmean(residual) / f_mean if f_mean > 0 else math.inf
    if f_noise > MAX_NOISE:
        raise AdviceRefused(
            f"the FFN window is too noisy: FFN compute per step strays {f_noise:.0%} on average "
            f"from its fit in tokens per step, above {MAX_NOISE:.0%}; ask again later"
        )
    m, n = len(attention), len(ffn)
    a_now = m / n
    b = statistics.fmean([x for x, _, _ in a_points])
    if b <= 0:
        raise AdviceRefused("the attention workers report 0 tokens per step: no traffic yet")
    t_a = statistics.fmean([c for _, c, _ in a_points]) / layers  # per layer, seconds
    c0, c1 = c0_step / layers, c1_step / layers
    t_f_now = c0 + c1 * a_now * b
    ffn_tokens = statistics.fmean([x for x, _, _ in f_points])
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
    balanced = (t_a - c0) / (c1 * b) if c1 > 0 else math.inf
    notes: list[str] = []
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
    if balanced < 1:
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
        },
        balanced_ratio=balanced,
        recommended=f"{best.attention}:{best.ffn}",
        candidates=candidates,
        assumptions=[
            "each attention worker keeps its batch b whatever the ratio (its KV cache bounds "
            "it); each FFN worker serves A*b tokens per step",
            "ping-pong with two or more micro-batches hides the exchange: a layer costs "
            "max(T_a, T_f); at A:1 the faster side idles the rest",
            "T_f is linear in tokens per step (fitted over the window); T_a is measured at b",
            "one GPU per worker; tokens/s per GPU counts attention and FFN GPUs alike",
        ],
        notes=notes,
    )


def format_advice(advice: Advice) -> str:
    i = advice.inputs
    lines = [
        f"bottleneck   {advice.bottleneck} side: {advice.why}",
        f"formula      {advice.formula}",
        f"inputs       M={i['M_attention_workers']:.0f} N={i['N_ffn_workers']:.0f} "
        f"b={i['b_tokens_per_attention_step']:.1f} tokens L={i['L_layers']:.0f} "
        f"T_a(b)={i['T_a_ms_per_layer']:.3f} ms c0={i['c0_ms_per_layer']:.3f} ms "
        f"c1={i['c1_us_per_token_per_layer']:.3f} us/token "
        f"(from {i['attention_steps']:.0f} attention and {i['ffn_steps']:.0f} FFN steps)",
        f"balance      A* = {advice.balanced_ratio:.2f} attention per FFN worker; "
        f"best candidate {advice.recommended}",
        "",
        f"{'RATIO':>7} {'LAYER MS':>9} {'BOTTLENECK':>10} {'TOKENS/S/GPU':>13}",
    ]
    for c in advice.candidates:
        lines.append(
            f"{c.attention:>5}:{c.ffn:<1} {c.layer_ms:>9.3f} {c.bottleneck:>10} "
            f"{c.tokens_per_s_per_gpu:>13.1f}"
        )
    lines += ["", "assumptions"] + [f"  - {a}" for a in advice.assumptions]
    if advice.notes:
        lines += ["notes"] + [f"  - {n}" for n in advice.notes]
    return "\n".join(lines)
