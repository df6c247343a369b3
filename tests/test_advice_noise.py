"""Issue 38: `afd-ctl advise` on windows that look like a real pair's, not a lab's.

A real CPU pair's window holds a few compile steps of seconds that no payload flagged as
warm-up, 30-40% jitter from step to step (a shared machine) and steps of 1 to 22 tokens. The
advice must answer such a window (never refuse it), land near the model's A*, and say how far
to trust it: an interval that holds the true A*, and a note when the window is noisy.
"""

from __future__ import annotations

import math
import random

import pytest

from afd_ctl.advice import AdviceRefused, advise
from afd_ctl.step_window import StepWindows
from afd_ctl.v1 import afd_pb2

LAYERS = 4


def noisy_report(
    rng: random.Random,
    first: int,
    steps: int,
    cost,  # tokens -> compute seconds per layer, noiseless
    jitter: float,
    spikes: dict[int, float],
) -> afd_pb2.StepTimings:
    r = afd_pb2.StepTimings(first_step_id=first, last_step_id=first + steps - 1, layers=LAYERS)
    for step_id in range(first, first + steps):
        tokens = rng.choice((1, 2, 3, 4, 4, 4, 5, 6, 8, 12, 22))
        compute = spikes.get(step_id) or LAYERS * cost(tokens) * (1 + rng.uniform(-jitter, jitter))
        wait = 0.3 * compute
        r.steps += 1
        r.compute_s += compute
        r.wait_s += wait
        r.busy_wall_s += compute + wait
        r.tokens += tokens
        r.step_compute_s.append(compute)
        r.step_wait_s.append(wait)
        r.step_tokens.append(tokens)
    return r


def real_like_window(
    seed: int,
    t_a: float,
    c0: float,
    c1: float,
    *,
    jitter: float,
    reports: int = 30,
    steps: int = 25,
    spike_s: float = 10.0,
) -> afd_pb2.Timings:
    """Two workers' windows through the daemon's own StepWindows: `reports` reports of `steps`
    steps each, per layer attention t_a and FFN c0 + c1 * tokens, each step off by up to
    +-`jitter`, and three unflagged 10 s compile steps at the start of each side plus one stall
    of 3 s later on."""
    rng = random.Random(seed)
    windows = StepWindows()
    out = afd_pb2.Timings(window_reports=windows.window_reports)
    spikes = {1: spike_s, 2: spike_s, 3: spike_s, 17 * steps // 2: 3.0}
    for worker_id, role, role_proto, cost in (
        ("attention-dp0", "attention", afd_pb2.ATTENTION, lambda _: t_a),
        ("ffn-0", "ffn", afd_pb2.FFN, lambda tokens: c0 + c1 * tokens),
    ):
        window = windows.window(worker_id, role, 0)
        for i in range(reports):
            report = noisy_report(rng, 1 + i * steps, steps, cost, jitter, spikes)
            assert windows.record(worker_id, role, 0, report, now=float(i)), window.last_refusal
        load = afd_pb2.WorkerLoad(worker_id=worker_id, role=role_proto, layers=LAYERS)
        out.workers.add(load=load, window=list(window.reports))
    return out


def true_ratio(advice, t_a: float, c0: float, c1: float) -> float:
    return (t_a - c0) / (c1 * advice.inputs["b_tokens_per_attention_step"])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("jitter", [0.3, 0.4])
def test_a_jittery_window_with_compile_spikes_is_answered_near_the_model(seed: int, jitter: float):
    """The simulated pair's model (attention 0.5 ms, FFN 0.1 ms + 6 us per token a layer) under
    real noise: answered, T_a and the FFN line within 10% of the model, and the true A* in the
    interval; the 10 s compile steps move none of it."""
    t_a, c0, c1 = 0.5e-3, 0.1e-3, 6e-6
    advice = advise(real_like_window(seed, t_a, c0, c1, jitter=jitter))
    i = advice.inputs
    assert i["T_a_ms_per_layer"] == pytest.approx(1e3 * t_a, rel=0.1)
    # c0 and c1 trade off against each other within the window's noise; T_f at b does not.
    b = i["b_tokens_per_attention_step"]
    t_f = i["c0_ms_per_layer"] + i["c1_us_per_token_per_layer"] * b / 1e3
    assert t_f == pytest.approx(1e3 * (c0 + c1 * b), rel=0.1)
    lo, hi = advice.balanced_ratio_interval
    truth = true_ratio(advice, t_a, c0, c1)
    assert lo <= truth <= hi, (lo, truth, hi, advice.balanced_ratio)
    assert math.isfinite(lo) and lo > 1
    assert advice.bottleneck == "attention"
    # 30-40% uniform jitter is a robust spread of 22-30%: said in a note whenever it is noisy.
    if advice.noisy:
        assert any(n.startswith("noisy window") for n in advice.notes), advice.notes


@pytest.mark.parametrize("seed", range(3))
def test_a_window_like_the_readme_cpu_pair_is_answered_with_its_interval(seed: int):
    """The README's real CPU pair (per layer attention 2.3 ms, FFN 1.0 ms + 12 us per token,
    steps of 1 to 22 tokens, 35% jitter): its FFN barely grows with tokens, so A* is poorly
    pinned down. The window used to be refused ("too noisy ... 36%"); now it is answered, as
    noisy, with an interval that holds the model's A*."""
    t_a, c0, c1 = 2.3e-3, 1.0e-3, 12e-6
    advice = advise(real_like_window(seed, t_a, c0, c1, jitter=0.35))
    lo, hi = advice.balanced_ratio_interval
    assert lo <= true_ratio(advice, t_a, c0, c1) <= hi, (lo, hi, advice.inputs)
    assert advice.noisy and advice.bottleneck == "attention"
    note = next(n for n in advice.notes if n.startswith("noisy window"))
    assert f"[{lo:.2f}, {hi:.2f}]" in note
    assert advice.inputs["T_a_ms_per_layer"] == pytest.approx(2.3, rel=0.1)


def test_warmup_spikes_flagged_by_the_worker_never_reach_the_window():
    """Reports flagged as warm-up (the worker's own flag, or the daemon's overlap with a
    relayed warm-up step) are counted apart: the window and so the advice never see them."""
    rng = random.Random(7)
    windows = StepWindows()
    window = windows.window("a", "attention", 0)
    warm = noisy_report(rng, 1, 3, lambda _: 0.0, 0.0, {1: 10.0, 2: 10.0, 3: 10.0})
    warm.warmup = True
    assert windows.record("a", "attention", 0, warm, now=0.0)
    assert (window.warmup_steps, len(window.reports)) == (3, 0)
    assert window.warmup_compute_s == pytest.approx(30.0)


def test_only_nonsense_is_refused():
    """No serving steps, steps without tokens or without compute time are refused (exit 3 in
    the CLI); a window of 3 steps, or one whose every step is noise, is answered."""
    t_a, c0, c1 = 0.5e-3, 0.1e-3, 6e-6
    empty = real_like_window(0, t_a, c0, c1, jitter=0.3, reports=0)
    with pytest.raises(AdviceRefused, match="no serving steps yet"):
        advise(empty)
    three = advise(real_like_window(0, t_a, c0, c1, jitter=0.3, reports=1, steps=3, spike_s=0))
    assert three.noisy and three.notes[0].startswith("short window: 3 attention steps in 1 report")
    no_compute = real_like_window(0, t_a, c0, c1, jitter=0.3)
    for r in no_compute.workers[0].window:
        r.compute_s = 0.0
        r.step_compute_s[:] = [0.0] * len(r.step_compute_s)
    with pytest.raises(AdviceRefused, match="no compute time"):
        advise(no_compute)
    no_tokens = real_like_window(0, t_a, c0, c1, jitter=0.3)
    for w in no_tokens.workers:
        for r in w.window:
            r.tokens = 0
            r.step_tokens[:] = [0] * len(r.step_tokens)
    with pytest.raises(AdviceRefused, match="0 tokens per step"):
        advise(no_tokens)
    wild = advise(real_like_window(1, t_a, c0, c1, jitter=0.9))
    assert wild.noisy and wild.recommended.endswith(":1")


@pytest.mark.parametrize("c1", [6e-6, 0.0])
def test_an_ffn_whose_fixed_cost_alone_exceeds_attention_limits_at_every_ratio(c1: float):
    """A loaded FFN host (the real pair's FFN at 4.3 ms a layer against attention's 1.7 ms):
    A* is 0, not a negative ratio (nor infinite when the FFN does not grow with tokens), with
    its interval at 0 and a note that says why."""
    advice = advise(real_like_window(0, 1.7e-3, 4.0e-3, c1, jitter=0.0, spike_s=0))
    assert advice.balanced_ratio == 0 and advice.bottleneck == "ffn"
    assert advice.balanced_ratio_interval == (0.0, 0.0) and not advice.noisy
    assert any("limits at every ratio" in n for n in advice.notes), advice.notes
    noisy = advise(real_like_window(1, 1.7e-3, 2.0e-3, 30e-6, jitter=0.4))
    lo, hi = noisy.balanced_ratio_interval
    assert noisy.balanced_ratio == 0 and 0 <= lo <= hi, (lo, hi)
