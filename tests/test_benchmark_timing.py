"""The benchmarks' timing checks (benchmarks/timing_stats.py) fed timings by hand: what a run
with a slow first repeat, a negative TPOT, a tokens/s that disagrees with TPOT, or a wide
spread gives. Pure logic: no vLLM, no processes."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import pytest

from benchmarks.timing_stats import (
    BenchmarkRefused,
    RequestTiming,
    Spread,
    added_per_layer_us,
    bounded_spread,
    decode_run,
    late_events,
    ratio,
    refuse_late_events,
)


def batch(tpot_s: float, n: int, tokens: int, first_s: float = 100.0) -> list[RequestTiming]:
    """`n` requests that decoded together: first token at `first_s`, then a token per TPOT."""
    last = first_s + tpot_s * (tokens - 1)
    return [RequestTiming(first_s, last, tokens) for _ in range(n)]


def test_tpot_is_the_decode_steps_alone_whatever_the_prefill_took() -> None:
    # A slow prefill (a late compile, the scheduler's first step) delays the first token; the
    # wall time of generate() grows with it, the TPOT does not.
    quick = decode_run(batch(0.004, 16, 64, first_s=100.0), 64, wall_s=0.30, what="quick")
    slow = decode_run(batch(0.004, 16, 64, first_s=103.0), 64, wall_s=3.30, what="slow")
    assert quick.tpot_s == pytest.approx(0.004)
    assert slow.tpot_s == pytest.approx(quick.tpot_s)
    assert slow.tokens_per_s == pytest.approx(16 / 0.004)


def test_the_old_difference_formula_goes_negative_where_the_new_one_does_not() -> None:
    # What issue 28 saw: (t(N) - t(1)) / (N - 1) with a 1-token run slower than the 64-token
    # one. The same engine's per-request stamps still give the decode time.
    t1, t64 = 0.40, 0.33  # the 1-token run paid a late capture
    assert (t64 - t1) / 63 < 0
    run = decode_run(batch(0.0045, 256, 64), 64, wall_s=t64, what="batch 256")
    assert run.tpot_s == pytest.approx(0.0045)


def test_a_negative_or_zero_tpot_is_refused() -> None:
    backwards = [RequestTiming(first_token_s=10.0, last_token_s=9.9, output_tokens=64)]
    with pytest.raises(BenchmarkRefused, match=r"TPOT \(s\) is -"):
        decode_run(backwards, 64, wall_s=1.0, what="batch 1")
    frozen = [RequestTiming(10.0, 10.0, 64)]
    with pytest.raises(BenchmarkRefused, match="must be positive"):
        decode_run(frozen, 64, wall_s=1.0, what="batch 1")
    with pytest.raises(BenchmarkRefused, match="must be positive"):
        bounded_spread([2.5, -1.195, 2.6], 0.15, "TPOT (ms)")
    with pytest.raises(BenchmarkRefused, match="must be positive"):
        bounded_spread([2.5, math.nan], 0.15, "TPOT (ms)")


def test_tokens_per_s_that_disagrees_with_batch_over_tpot_is_refused() -> None:
    # Half the batch decoded after the other half (not one batch): each request's TPOT is the
    # same, but the batch's decode span is twice as long.
    early = batch(0.004, 8, 64, first_s=100.0)
    late = batch(0.004, 8, 64, first_s=100.0 + 0.004 * 63)
    with pytest.raises(BenchmarkRefused, match="did not decode together"):
        decode_run(early + late, 64, wall_s=1.0, what="batch 16")


def test_short_or_preempted_requests_and_foreign_timestamps_are_refused() -> None:
    short = batch(0.004, 3, 64)[:2] + [RequestTiming(100.0, 100.1, 40)]
    with pytest.raises(BenchmarkRefused, match="request 2 generated 40 of 64"):
        decode_run(short, 64, wall_s=1.0, what="b")
    preempted = [RequestTiming(100.0, 100.252, 64, preemptions=1)]
    with pytest.raises(BenchmarkRefused, match="preempted"):
        decode_run(preempted, 64, wall_s=1.0, what="b")
    # A decode span longer than generate() took: stamps from another run, or a broken clock.
    with pytest.raises(BenchmarkRefused, match="longer than generate"):
        decode_run(batch(0.004, 4, 64), 64, wall_s=0.1, what="b")
    with pytest.raises(BenchmarkRefused, match="at least 2"):
        decode_run(batch(0.004, 4, 1), 1, wall_s=0.1, what="b")


def test_a_slow_first_repeat_makes_the_spread_wide_and_the_run_refused() -> None:
    with pytest.raises(BenchmarkRefused, match=r"spread .* wider than the bound 0.15") as err:
        bounded_spread([6.1, 2.7, 2.66, 2.68, 2.7], 0.15, "batch 64: TPOT (ms)")
    assert "6.1" in str(err.value)  # the message shows the repeats
    # Within the bound: the median stands, min and max come with it.
    spread = bounded_spread([2.7, 2.66, 2.68, 2.75, 2.7], 0.15, "batch 64: TPOT (ms)")
    assert (spread.low, spread.median, spread.high, spread.n) == (2.66, 2.7, 2.75, 5)
    assert spread.as_dict() == {"min": 2.66, "median": 2.7, "max": 2.75, "n": 5}


def test_ratio_and_added_time_per_layer_come_from_medians_with_their_range() -> None:
    afd = Spread.of([16.0, 16.8, 17.5])
    colocated = Spread.of([6.0, 6.2, 6.5])
    r = ratio(afd, colocated)
    assert r.value == pytest.approx(16.8 / 6.2)
    assert (r.low, r.high) == (pytest.approx(16.0 / 6.5), pytest.approx(17.5 / 6.0))
    added = added_per_layer_us(afd, colocated, layers=4)
    assert added.value == pytest.approx((16.8 - 6.2) / 4 * 1000)
    assert added.low < added.value < added.high


def test_a_compile_or_late_capture_inside_the_timed_region_refuses_the_run() -> None:
    before = {"triton_kernels_compiled": 40, "ffn_late_graph_captures": 0}
    after = {"triton_kernels_compiled": 40, "ffn_late_graph_captures": 2}
    events = late_events(before, after)
    assert events == {"ffn_late_graph_captures": 2}
    with pytest.raises(BenchmarkRefused, match="ffn_late_graph_captures \\+2"):
        refuse_late_events(events, "batch 64, repeat 0")
    refuse_late_events(late_events(after, after), "nothing grew")


def test_a_refusal_for_a_triton_compile_names_the_kernels(tmp_path, monkeypatch) -> None:
    from benchmarks.decode_runner import LateEventCounters

    def compiled(name: str, digest: str) -> None:  # as Triton lays out one kernel
        entry = tmp_path / digest
        entry.mkdir()
        for file in (f"{name}.json", f"{name}.cubin", f"__grp__{name}.json"):
            (entry / file).write_text("{}")

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "no-vllm-cache"))
    compiled("triton_poi_fused_0", "AAAA")
    counters = LateEventCounters("")
    cached = counters.cache_entries()
    before = counters.snapshot(cached)
    compiled("fused_moe_kernel", "BBBB")
    compiled("triton_red_fused_1", "CCCC")
    now = counters.cache_entries()
    new = counters.kernel_names(now - cached)
    assert new == ["fused_moe_kernel", "triton_red_fused_1"]
    with pytest.raises(BenchmarkRefused) as refused:
        refuse_late_events(late_events(before, counters.snapshot(now)), "batch 16, repeat 0", new)
    assert "triton_kernels_compiled +2; Triton kernels compiled: fused_moe_kernel, " \
        "triton_red_fused_1" in str(refused.value)  # fmt: skip


def gpu_args(**over: object) -> argparse.Namespace:
    base = {"layers": 4, "tokens": 64, "repeats": 3, "spread_bound": 0.0, "gpu": True,
            "one_gpu": False,
            "batches": "64"}  # fmt: skip
    base.update(over)
    return argparse.Namespace(**base)


def gpu_run(tpots: list[float], mps: bool = True) -> dict[str, object]:
    spread = Spread.of(tpots)
    return {
        "mps": mps,
        "placement": "own GPU(s)",
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "batches": {
            "64": {
                "tpot_ms": spread.as_dict(4),
                "tpot_ms_repeats": tpots,
                "decode_tokens_per_s": Spread.of([64e3 / t for t in tpots]).as_dict(1),
                "token_ids": [[1, 2]],
            }
        },
    }


def test_gpu_summary_gives_ratio_added_time_and_mps_from_the_runs() -> None:
    from benchmarks.e2e_decode import gpu_summary

    state = {
        "colocated_1gpu": {"runs": [gpu_run([4.0, 4.1, 4.2]), gpu_run([4.1, 4.2, 4.3])]},
        "afd": {"runs": [gpu_run([9.6, 9.7, 9.8])]},
    }
    summary = gpu_summary(state, gpu_args())
    row = summary["batch_64"]
    assert summary["mps"] is True
    assert row["tpot_ms_colocated_1gpu"] == 4.15  # median of all six repeats
    assert row["ratio_tpot_afd_vs_colocated_1gpu"] == round(9.7 / 4.15, 3)
    assert row["ratio_tpot_afd_vs_colocated_1gpu_range"] == [round(9.6 / 4.3, 3), 2.45]
    assert row["per_layer_added_us"] == round((9.7 - 4.15) / 4 * 1000, 1)
    assert summary["cudagraph_mode_by_part"]["afd"] == ["FULL_DECODE_ONLY"]


def test_gpu_summary_refuses_runs_that_disagree_or_mixed_mps() -> None:
    from benchmarks.e2e_decode import gpu_summary

    drifting = {"colocated_1gpu": {"runs": [gpu_run([2.66] * 3), gpu_run([4.27] * 3)]}}
    with pytest.raises(BenchmarkRefused, match="run medians .* wider than the bound"):
        gpu_summary(drifting, gpu_args())
    mixed = {
        "colocated_1gpu": {"runs": [gpu_run([4.0] * 3, mps=False)]},
        "afd": {"runs": [gpu_run([9.7] * 3, mps=True)]},
    }
    with pytest.raises(BenchmarkRefused, match="MPS was on in some runs"):
        gpu_summary(mixed, gpu_args())


def serve_result(**over: float) -> dict[str, float]:
    """A plausible `vllm bench serve` result: 12 prompts, 8 tokens out, concurrency 2."""
    result = {
        "completed": 12, "duration": 4.0, "total_output_tokens": 96, "request_throughput": 3.0,
        "output_throughput": 24.0, "median_ttft_ms": 120.0, "p99_ttft_ms": 200.0,
        "median_tpot_ms": 60.0, "p99_tpot_ms": 75.0, "median_itl_ms": 60.0, "p99_itl_ms": 90.0,
        "mean_e2el_ms": 600.0,
    }  # fmt: skip
    result.update(over)
    return result


def test_serve_results_that_cannot_be_right_are_refused() -> None:
    from benchmarks.timing_stats import check_serve_run

    check_serve_run(serve_result(), 12, 8, 2, "ok")
    cases = {
        "10 of 12 requests completed": serve_result(completed=10),
        "median_tpot_ms is -": serve_result(median_tpot_ms=-3.0),
        "median_ttft_ms is 0": serve_result(median_ttft_ms=0.0),
        "80 output tokens, 12 x 8 asked": serve_result(total_output_tokens=80),
        "disagrees with 96 tokens": serve_result(output_throughput=30.0),
        "median tpot 80.0 ms above its p99": serve_result(median_tpot_ms=80.0),
        # 2 requests in flight at 300 ms each cannot give 24 tokens/s of 8-token requests
        "more than 2 requests in flight": serve_result(mean_e2el_ms=300.0 * 2.5),
    }
    for reason, result in cases.items():
        with pytest.raises(BenchmarkRefused, match=reason):
            check_serve_run(result, 12, 8, 2, "c2")


def test_serve_repeats_give_medians_and_refuse_a_wide_spread() -> None:
    from benchmarks.serve_bench import over_repeats

    runs = [serve_result(output_throughput=t, median_tpot_ms=m)
            for t, m in ((24.0, 60.0), (23.0, 61.0), (25.0, 59.0))]  # fmt: skip
    figures = over_repeats(runs, 0.15, "afd, concurrency 2")
    assert figures["output_throughput"] == 24.0
    assert figures["output_throughput_spread"] == {"min": 23.0, "median": 24.0, "max": 25.0, "n": 3}
    assert figures["repeats"] == 3
    runs[0]["output_throughput"] = 12.0  # a slow first repeat
    with pytest.raises(BenchmarkRefused, match="output_throughput: spread"):
        over_repeats(runs, 0.15, "afd, concurrency 2")


def test_data_plane_figures_that_cannot_be_right_are_refused() -> None:
    from benchmarks.data_plane import check_figures

    good = {
        "rt_1p75MiB_p50_us": 90.0, "rt_1p75MiB_p99_us": 140.0,
        "rt_1p75MiB_p50_rounds_us": {"min": 88.0, "median": 90.0, "max": 95.0, "n": 4},
        "bw_256MiB_GBps": 300.0, "floor_bw_256MiB_GBps": 320.0, "ratio_bw_vs_floor": 0.94,
    }  # fmt: skip
    check_figures(good)
    with pytest.raises(BenchmarkRefused, match="rt_1p75MiB_p50_us 150.0 is above its p99"):
        check_figures({**good, "rt_1p75MiB_p50_us": 150.0})
    with pytest.raises(BenchmarkRefused, match="rt_1p75MiB_p50_us is 0.0"):
        check_figures({**good, "rt_1p75MiB_p50_us": 0.0})
    with pytest.raises(BenchmarkRefused, match="beats the copy floor"):
        check_figures({**good, "bw_256MiB_GBps": 480.0, "ratio_bw_vs_floor": 1.5})


def test_interleaved_ratio_comes_with_an_interval_that_covers_it() -> None:
    from benchmarks.interleave import ratio_interval

    colocated = [5.00, 5.02, 4.98, 5.01, 4.99]
    afd = [5.10, 5.12, 5.08, 5.11, 5.60]  # one slow repeat: noise, measured not refused
    r = ratio_interval(afd, colocated)
    assert r.value == pytest.approx(5.11 / 5.00)
    assert r.low <= r.value <= r.high
    assert r.relative_width < 0.15
    # The same samples twice: the same interval (seeded resampling).
    assert ratio_interval(afd, colocated) == r


def test_layer_fit_recovers_what_is_added_per_step_and_per_layer() -> None:
    from benchmarks.interleave import layer_fit

    # colocated 1 ms a layer; AFD adds 0.2 ms a step and 0.025 ms a layer.
    colocated = {2: [2.0] * 5, 4: [4.0] * 5}
    afd = {2: [2.0 + 0.2 + 0.05] * 5, 4: [4.0 + 0.2 + 0.1] * 5}
    step, layer = layer_fit(afd, colocated)
    assert step.value == pytest.approx(200.0)
    assert layer.value == pytest.approx(25.0)
    with pytest.raises(BenchmarkRefused, match="two depths or more"):
        layer_fit({2: [1.0]}, {2: [1.0]})
    # Three depths (2, 3, 4 layers): the least-squares line; exact on a line.
    colocated3 = {**colocated, 3: [3.0] * 5}
    afd3 = {**afd, 3: [3.0 + 0.2 + 0.075] * 5}
    step, layer = layer_fit(afd3, colocated3)
    assert (step.value, layer.value) == (pytest.approx(200.0), pytest.approx(25.0))


def test_depth_fit_only_fits_depths_of_one_pacing() -> None:
    """A shallow depth whose steps wait for the host (host lead < 0 in the AFD part's
    timeline) is not fitted with deeper GPU-paced ones: the line would measure the host."""
    from benchmarks.e2e_interleaved import depth_fit

    def run(depth: int, added_ms: float, lead_ms: float | None) -> dict:
        rows = {} if lead_ms is None else {"16": {"host_lead_ms": lead_ms}}
        return {
            "tpot_ms": {"colocated": {16: [1.0 * depth] * 5}, "afd": {16: [depth + added_ms] * 5}},
            "timelines": {"afd": {"by_rows": rows}},
        }

    # 2 layers host-paced (its added time is the host's), 4 and 6 GPU-paced: 0.1 ms a step
    # and 0.02 ms a layer from 4 and 6 alone.
    depths = {2: [run(2, 0.6, -0.9)], 4: [run(4, 0.18, 2.6)], 6: [run(6, 0.22, 2.4)]}
    fit = depth_fit(depths, "afd", 16)
    assert fit["paced_by"] == {"2": "host", "4": "gpu", "6": "gpu"}
    assert fit["left_out_depths"] == [2]
    assert fit["per_step_added_us"] == pytest.approx(100.0)
    assert fit["per_layer_added_us"] == pytest.approx(20.0)
    # One depth of each pacing: nothing fitted, and the answer says what to run.
    fit = depth_fit({2: depths[2], 4: depths[4]}, "afd", 16)
    assert "per_step_added_us" not in fit and "deeper depths" in fit["not_fitted"]
    # No timeline (the CPU runs): every depth is fitted.
    fit = depth_fit({2: [run(2, 0.14, None)], 4: [run(4, 0.18, None)]}, "afd", 16)
    assert fit["paced_by"] == {"2": "unknown", "4": "unknown"}
    assert fit["per_layer_added_us"] == pytest.approx(20.0)
    # A depth whose calls disagree on pacing is fitted with neither kind.
    fit = depth_fit({**depths, 4: [run(4, 0.18, 2.6), run(4, 0.18, -0.3)]}, "afd", 16)
    assert fit["paced_by"]["4"] == "mixed" and "mixed [4]" in fit["not_fitted"]


def test_several_calls_per_depth_give_means_whose_intervals_hold_the_start_offset() -> None:
    """Two 4-layer calls on one H100 (2026-12-07) gave 1.013 and 1.023, each interval 0.003 wide:
    over calls, the ratio is their mean and its interval spans them; the fit averages each
    depth's calls; the calls run 4, 6, then 6, 4, each under its own key in --state."""
    import argparse

    from benchmarks.e2e_interleaved import call_key, calls_of, next_depth, summarise
    from benchmarks.interleave import calls_layer_fit, calls_ratio_interval

    def call(colo: float, afd: float) -> tuple[list[float], list[float]]:
        return [afd + 0.001 * i for i in range(9)], [colo + 0.001 * i for i in range(9)]

    calls = [call(6.65, 6.80), call(6.65, 6.74)]
    one = [calls_ratio_interval([c]) for c in calls]
    assert one[0].high < one[1].low or one[1].high < one[0].low  # each call alone: disjoint
    both = calls_ratio_interval(calls)
    assert both.value == pytest.approx((one[0].value + one[1].value) / 2)
    assert both.low <= one[1].value and both.high >= one[0].value  # holds both calls
    # The fit: 6 layers' two calls added 0.22 and 0.24 ms, 4 layers' 0.15 and 0.09 ms.
    fit = {4: [call(6.65, 6.80), call(6.65, 6.74)], 6: [call(10.24, 10.46), call(10.25, 10.49)]}
    step, layer = calls_layer_fit(fit)
    assert layer.value == pytest.approx(((230 - 120) / 2), abs=0.5)
    assert step.value == pytest.approx(120 - 4 * layer.value, abs=0.5)
    assert layer.low < layer.value < layer.high
    # The order of the calls, and each call's key (a state from before keeps its first key).
    state: dict = {}
    order = []
    while (d := next_depth(state, "colocated+afd", [4, 6], 2)) is not None:
        order.append(d)
        state[call_key("colocated+afd", d, len(calls_of(state, "colocated+afd", d)) + 1)] = {}
    assert order == [4, 6, 6, 4]
    assert sorted(state) == [
        "colocated+afd@4",
        "colocated+afd@4#2",
        "colocated+afd@6",
        "colocated+afd@6#2",
    ]
    # The summary: means over calls, each call's own ratio beside them, the calls' fit.
    args = argparse.Namespace(
        part="colocated,afd", gpu=False, batches="16", tokens=64, repeats=9, interval_bound=0.25
    )

    def run(c: tuple[list[float], list[float]]) -> dict:
        return {
            "tpot_ms": {"colocated": {16: c[1]}, "afd": {16: c[0]}},
            "reports": {"colocated": {}, "afd": {}},
        }

    result = summarise(args, {d: [run(c) for c in cs] for d, cs in fit.items()})
    row = result["layers_4"]["batch_16"]
    assert row["calls"] == 2 and row["ratio_tpot_afd_vs_colocated"] == pytest.approx(
        both.value, abs=1e-3
    )
    assert [c["ratio"] for c in row["ratio_tpot_afd_vs_colocated_per_call"]] == [
        pytest.approx(one[0].value, abs=1e-3),
        pytest.approx(one[1].value, abs=1e-3),
    ]
    assert row["tpot_ms_afd"] == pytest.approx((6.804 + 6.744) / 2, abs=1e-3)
    assert result["fit_afd_batch_16"]["per_layer_added_us"] == pytest.approx(layer.value, abs=0.1)
    assert "t interval over the calls" in result["interval"]
    # Two calls' interval is a t interval with one degree of freedom: far wider than their
    # range (a bootstrap of two calls returns about their range, and covers their mean far
    # less often than 95%).
    spread = abs(one[0].value - one[1].value)
    assert both.high - both.low > 5 * spread
    # Calls that ran other settings are pooled and said to differ; a call without a batch
    # is left out of that batch's row and fit; one call's missing timeline row does not
    # make its depth's pacing "mixed".
    runs = {d: [run(c) for c in cs] for d, cs in fit.items()}
    runs[4][0]["settings"] = {"kv_cache_bytes": 1 << 30, "batches": "16"}
    runs[4][1]["settings"] = {"kv_cache_bytes": 2 << 30, "batches": "16,64"}
    runs[4][1]["tpot_ms"]["colocated"][64] = [7.6] * 9
    runs[4][1]["tpot_ms"]["afd"][64] = [7.7] * 9
    runs[6][1]["timelines"] = {"afd": {"by_rows": {"16": {"host_lead_ms": 2.0}}}}
    args.batches = "16,64"
    result = summarise(args, runs)
    assert result["layers_4"]["settings_differ"] == {
        "kv_cache_bytes": [1 << 30, 2 << 30],
        "batches": ["16", "16,64"],
    }
    assert result["layers_4"]["batch_64"]["calls"] == 1
    assert "batch_64" not in result["layers_6"] and "fit_afd_batch_64" not in result
    assert result["fit_afd_batch_16"]["paced_by"] == {"4": "unknown", "6": "gpu"}


def test_pooled_calls_of_other_code_or_another_card_are_said_to_differ(tmp_path) -> None:
    """A state carried to a later session pools its calls with new ones: each call keeps the
    digest of the product's code it measured and its card, and a pooled depth names both where
    they differ, and the machine each ran on. The digest follows the product's files, not the
    benchmarks' or their results."""
    import argparse
    import socket

    from benchmarks.e2e_interleaved import run_settings, settings_that_differ, source_digest

    for top in ("afd_ctl", "afd_data", "vllm_ext", "benchmarks"):
        (tmp_path / top).mkdir(parents=True)
    (tmp_path / "afd_data" / "gpu_hop.py").write_text("A = 1\n")
    first = source_digest(tmp_path)
    (tmp_path / "benchmarks" / "e2e_decode.py").write_text("harness\n")
    assert source_digest(tmp_path) == first
    (tmp_path / "afd_data" / "gpu_hop.py").write_text("A = 2\n")
    assert source_digest(tmp_path) != first

    settings = run_settings(argparse.Namespace(gpu=False, experts=16, batches="16,64"))
    assert settings["source"] == source_digest() and "gpu" not in settings
    assert settings["host"].startswith(socket.gethostname())  # which machine ran the call
    later = {**settings, "source": first, "gpu": "NVIDIA H200", "host": "other (CPU)"}
    assert settings_that_differ([{"settings": settings}, {"settings": later}]) == {
        "source": [settings["source"], first],
        "gpu": [None, "NVIDIA H200"],
        "host": [settings["host"], "other (CPU)"],
    }


def test_a_fit_over_calls_of_two_machines_gives_each_machines_own_fit() -> None:
    """The fifteenth session pooled two H100s' calls: colocated ran alike on both, AFD ~17 µs
    a layer on one and ~44 on the other. The pooled fit stays; beside it each machine's own."""
    import argparse

    from benchmarks.e2e_interleaved import summarise

    def run(host: str, depth: int, per_layer_us: float) -> dict:
        colo = [0.75 * depth + 0.001 * i for i in range(9)]
        afd = [c + (100 + per_layer_us * depth) / 1e3 for c in colo]
        return {
            "tpot_ms": {"colocated": {16: colo}, "afd": {16: afd}},
            "reports": {"colocated": {}, "afd": {}},
            "settings": {"host": host},
        }

    runs = {
        d: [run("a (EPYC)", d, 17), run("b (EPYC)", d, 44), run("b (EPYC)", d, 44)] for d in (8, 16)
    }
    args = argparse.Namespace(
        part="colocated,afd", gpu=False, batches="16", tokens=64, repeats=9, interval_bound=0.25
    )
    result = summarise(args, runs)
    fit = result["fit_afd_batch_16"]
    assert 17 < fit["per_layer_added_us"] < 44
    assert fit["by_host"]["a (EPYC)"]["per_layer_added_us"] == pytest.approx(17, abs=0.5)
    assert fit["by_host"]["b (EPYC)"]["per_layer_added_us"] == pytest.approx(44, abs=0.5)
    assert fit["by_host"]["b (EPYC)"]["calls"] == 4
    assert result["layers_8"]["settings_differ"] == {"host": ["a (EPYC)", "b (EPYC)", "b (EPYC)"]}
    # One machine (or none recorded): no by_host.
    one = {d: [run("a (EPYC)", d, 17)] * 2 for d in (8, 16)}
    assert "by_host" not in summarise(args, one)["fit_afd_batch_16"]


def test_expected_distinct_experts_under_uniform_routing() -> None:
    from benchmarks.interleave import expected_distinct_experts

    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(256, 8, 16) == pytest.approx(102.0, abs=0.5)
    assert expected_distinct_experts(256, 8, 256) > 255


def test_interleaved_summary_compares_every_later_part_with_every_earlier_one() -> None:
    """Issue 34: AFD with dual-batch overlap beside AFD and colocated; each ratio with its
    interval, a noisy pair refused by name, the exchange and timeline per AFD part."""
    import argparse

    from benchmarks.e2e_interleaved import parts_of, summarise

    args = argparse.Namespace(
        part="colocated,afd,afd_dbo", gpu=True, batches="64,256", tokens=256, repeats=5,
        interval_bound=0.25, cudagraph_mode="FULL_DECODE_ONLY", experts=128, prompt_tokens=4096,
    )  # fmt: skip
    assert parts_of(args) == ["colocated", "afd", "afd_dbo"]
    tpot = {
        "colocated": {64: [5.0] * 5, 256: [8.0] * 5},
        "afd": {64: [5.1] * 5, 256: [8.2] * 5},
        "afd_dbo": {64: [5.0] * 5, 256: [1.0, 6.0, 6.5, 7.0, 20.0]},
    }
    reports = {p: {"afd_exchange": {"gpu_driven": 1.0}} for p in ("afd", "afd_dbo")}
    run = {"tpot_ms": tpot, "reports": {"colocated": {}, **reports}, "timelines": {}}
    result = summarise(args, {3: [run]})
    row = result["layers_3"]["batch_256"]
    assert row["ratio_tpot_afd_vs_colocated"] == pytest.approx(8.2 / 8.0, abs=1e-3)
    assert row["ratio_tpot_afd_dbo_vs_afd"] == pytest.approx(6.5 / 8.2, abs=1e-3)
    assert row["ratio_tpot_afd_dbo_vs_colocated"] == pytest.approx(6.5 / 8.0, abs=1e-3)
    assert row["repeats"] == 5 and result["max_repeats"] == 5
    # Long prompts (attention the larger part of a step) get a model length that holds them.
    assert result["max_model_len"] == 4096 + 256 + 16
    assert set(result["layers_3"]) >= {"afd_exchange", "afd_dbo_exchange", "afd_dbo_timeline"}
    assert result["routed_experts_per_moe_layer"] == 128
    assert result["distinct_experts_per_moe_layer_per_step"]["256"] > 127
    assert any("batch 256: afd_dbo / colocated interval" in r for r in result["refused"])
    assert not any("batch 64" in r for r in result["refused"])
    for bad in ("afd,afd", "afd", "colocated,afd_ep2"):
        with pytest.raises(SystemExit, match="give two or more"):
            parts_of(argparse.Namespace(part=bad, gpu=True))
    for gpu_only in ("afd_dbo", "afd_memset", "afd_resets"):
        with pytest.raises(SystemExit, match=f"--part {gpu_only} needs --gpu"):
            parts_of(argparse.Namespace(part=f"colocated,{gpu_only}", gpu=False))
    assert (
        parts_of(argparse.Namespace(part="colocated,afd,afd_memset", gpu=True))[-1] == "afd_memset"
    )


def test_the_afd_base_part_runs_every_process_from_the_other_checkout(tmp_path) -> None:
    """`--part colocated,afd_base,afd --base-tree DIR`: before and after a change in one call;
    the base part's processes start in DIR, with DIR first on their path and DIR's runner."""
    import argparse
    import os

    from benchmarks.e2e_decode import RUNNER
    from benchmarks.e2e_interleaved import from_tree, parts_of

    args = argparse.Namespace(part="colocated,afd_base,afd", gpu=True, base_tree="")
    with pytest.raises(SystemExit, match="needs --base-tree DIR"):
        parts_of(args)
    args.base_tree = str(tmp_path)
    with pytest.raises(SystemExit, match="has no benchmarks/decode_runner.py"):
        parts_of(args)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "decode_runner.py").write_text("")
    assert parts_of(args) == ["colocated", "afd_base", "afd"]
    argv, env = from_tree(tmp_path, ["python", str(RUNNER), "--tokens", "8"], {"PYTHONPATH": "x"})
    assert argv == ["python", str(tmp_path / "benchmarks" / "decode_runner.py"), "--tokens", "8"]
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "x"])


def test_the_v3_shaped_model_can_have_fewer_experts_so_deeper_models_fit_two_engines() -> None:
    """Issue 33's fit needs colocated and AFD at 4 layers on one H200 at once (141 GB of
    experts at V3's 256): a smaller expert count, the same for every part, stated in the JSON."""
    from benchmarks.gpu_setup import v3_shaped_config

    assert v3_shaped_config(4)["n_routed_experts"] == 256
    config = v3_shaped_config(4, 128)
    assert (config["n_routed_experts"], config["n_group"]) == (128, 8)
    # long prompts (dual-batch overlap's runs) raise the positions the model takes
    assert config["max_position_embeddings"] == 4096
    assert v3_shaped_config(4, 64, 16528)["max_position_embeddings"] == 16528
    assert v3_shaped_config(16, 16)["n_routed_experts"] == 16  # the wide depth span's fit
    for bad in (100, 8, 12, 512):
        with pytest.raises(ValueError, match="multiple of 8"):
            v3_shaped_config(4, bad)


def test_each_engines_kv_cache_is_sized_to_the_run_unless_given() -> None:
    """A fixed 8 GiB KV cache a server put the 4-layer `--experts 64` pair over an 80 GB card
    (the colocated engine ran out of memory capturing its graphs): without --kv-cache-bytes
    each engine holds what the largest batch needs; a given size too small to hold the batch
    is refused before any engine starts, saying the size it needs."""
    from benchmarks.e2e_interleaved import kv_cache_bytes

    short = argparse.Namespace(prompt_tokens=128, tokens=256, kv_cache_bytes=None)
    assert kv_cache_bytes(short, 4, 256) == 1 << 30  # 0.45 GB needed: the 1 GiB floor
    long = argparse.Namespace(prompt_tokens=16384, tokens=256, kv_cache_bytes=None)
    need = 256 * 16656 * 4 * 1152  # whole 16-token blocks; MLA: (512 + 64) bf16 a layer
    assert need < kv_cache_bytes(long, 4, 256) <= need + (512 << 20)
    long.kv_cache_bytes = 20 << 30  # issue 34's run gives it: kept as given
    assert kv_cache_bytes(long, 4, 256) == 20 << 30
    long.kv_cache_bytes = 8 << 30
    with pytest.raises(BenchmarkRefused, match=f"needs {need} bytes"):
        kv_cache_bytes(long, 4, 256)


def test_timeline_splits_the_payload_hop_into_publish_transit_and_prelaunch(tmp_path) -> None:
    """Both sides' timeline lines joined by step: the hop from the attention host opening a
    step to the FFN host running it, in its three parts, per row count."""
    import json

    from benchmarks.timeline import summarise

    att, ffn = [], []
    for step in range(1, 31):
        t = 10.0 + step * 0.004  # a step every 4 ms
        att.append(
            {
                "step": step,
                "rows": 16,
                "host_open": t,
                "host_control": t + 50e-6,
                "host_enqueued": t + 1e-3,
                "gpu_start": t + 0.2e-3,
                "gpu_end": t + 3.2e-3,
                "host_tokens": t + 3.5e-3,
            }
        )
        ffn.append({"step": step, "rows": 16, "host_open": t + 300e-6,
                    "host_control": t + 250e-6, "host_enqueued": t + 400e-6,
                    "gpu_start": t + 0.3e-3, "gpu_end": t + 3.3e-3})  # fmt: skip
    (tmp_path / "attention-0-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in att))
    (tmp_path / "ffn-0-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ffn))
    rows = summarise(tmp_path)["by_rows"]["16"]
    assert rows["steps"] == 30
    assert rows["payload_hop_ms"] == pytest.approx(0.3)
    assert rows["publish_ms"] == pytest.approx(0.05)
    assert rows["payload_transit_ms"] == pytest.approx(0.2)
    assert rows["ffn_prelaunch_ms"] == pytest.approx(0.15)
    assert rows["ffn_prepare_ms"] == pytest.approx(0.05)
    assert rows["ffn_launch_ms"] == pytest.approx(0.1)
    assert rows["attention_gpu_idle_ms"] == pytest.approx(1.0)
    assert rows["ffn_launch_vs_attention_launch_ms"] == pytest.approx(-0.6)
    assert rows["tokens_after_gpu_end_ms"] == pytest.approx(0.3)
    assert rows["open_after_tokens_ms"] == pytest.approx(4.5)  # the step after next: 8 - 3.5 ms


def test_host_profile_summary_names_each_busy_thread_and_where_it_spent_its_samples() -> None:
    from benchmarks.host_profile import samples_taken, summarise

    main = 'process 7:"VLLM::EngineCore";thread (7): MainThread;run (vllm/core.py:10)'
    main += ";wrapped (vllm_ext/attention/step_failures.py:1)"  # ours around vLLM's step
    watch = 'process 7:"VLLM::EngineCore";thread (9): afd-gpu-watchdog;loop (threading.py:1)'
    raw = "\n".join([
        f"{main};step (vllm/core.py:20);open_step (vllm_ext/attention/steps.py:140) 30",
        f"{main};step (vllm/core.py:21);schedule (vllm/sched.py:5) 60",
        f"{main};step (vllm/core.py:22) 10",
        f"{watch};poll (vllm_ext/exchange/gpu_watchdog.py:200) 2",
        "garbage line",
    ])  # fmt: skip
    out = summarise(raw, wall_s=1.0, rate=100)
    assert [t["thread"] for t in out["threads"]] == ["MainThread"]  # 2% is not busy
    thread = out["threads"][0]
    assert thread["process"] == "VLLM::EngineCore"
    assert thread["active_share"] == pytest.approx(1.0)
    assert thread["afd_share"] == pytest.approx(0.3)
    assert thread["leaf"][0] == ["schedule (vllm/sched.py)", 0.6]
    # run() and step() are on every sample: left out of the inclusive list
    assert [name for name, _ in thread["inclusive"]] == [
        "schedule (vllm/sched.py)",
        "open_step (vllm_ext/attention/steps.py)",
    ]
    # where AFD's share went: its own functions, the wrapper on every sample left out
    assert thread["afd_inclusive"] == [["open_step (vllm_ext/attention/steps.py)", 0.3]]
    # py-spy lagging (125 samples in 2.0 s at 100 Hz, not 200): shares are of the samples it
    # says it took, not of rate x wall.
    lagged = summarise(raw, wall_s=2.0, rate=100, taken=samples_taken(PY_SPY_END))
    assert lagged["samples_taken"] == 125 and lagged["effective_rate_hz"] == 62.5
    assert lagged["threads"][0]["active_share"] == pytest.approx(100 / 125)


PY_SPY_END = (
    "py-spy> Stopped sampling because Control-C pressed\n"
    "py-spy> Wrote raw flamegraph data to 'x.txt'. Samples: 100 Errors: 25\n"
)


def test_host_profile_without_py_spy_says_why(tmp_path) -> None:
    from benchmarks.host_profile import Recording

    recording = Recording(str(tmp_path / "no-py-spy"), 1, tmp_path / "raw.txt")
    assert "no py-spy" in recording.stop(1.0)["error"]


def test_afd_host_time_per_step_parts() -> None:
    """The attention step machine's own host time: medians per part, open without publish."""
    from vllm_ext.attention.host_time import HostTime

    host = HostTime()
    assert host.stats() == {}
    for _ in range(3):
        host._step.update(open=100e-6, publish=40e-6, close=20e-6, connect=5e-6, begin=15e-6)
        host.step_done()
    assert host.stats() == {
        "afd_host_us_open_median": 60.0,
        "afd_host_us_publish_median": 40.0,
        "afd_host_us_close_median": 20.0,
        "afd_host_us_open_connect_median": 5.0,
        "afd_host_us_open_begin_median": 15.0,
        "afd_host_us_open_retired_median": 0.0,
        "afd_host_us_publish_direct_median": 0.0,
        "afd_host_us_close_enqueue_median": 0.0,
        "afd_host_us_close_closed_median": 0.0,
        "afd_host_us_per_step_median": 120.0,
        "afd_host_cpu_us_per_step_median": 0.0,
    }
    started = host.start()
    assert host.add("retired", started) >= started  # the next part starts where it ended
    # The runner's CPU time in open and close: a busy part counts, a sleeping one barely.
    host = HostTime()
    host.cpu_from()
    busy_from = time.thread_time()
    while time.thread_time() - busy_from < 0.02:  # 20 ms of this thread's CPU
        pass
    host.cpu_to()
    host.cpu_from()
    time.sleep(0.05)
    host.cpu_to()
    host.step_done()
    assert 20e3 <= host.stats()["afd_host_cpu_us_per_step_median"] < 45e3  # not the sleep's 50


def test_ffn_warm_up_covers_odd_row_counts_below_each_size() -> None:
    from vllm_ext.ffn.engine import warm_sizes

    assert warm_sizes(16) == [1, 2, 3, 4, 7, 8, 15, 16]
    assert warm_sizes(1) == [1]


def test_a_timeline_line_is_json_with_the_steps_stamps(tmp_path, monkeypatch) -> None:
    """vllm_ext.exchange.timeline writes one JSON line per retired step (formatted by hand,
    off json.dumps) that benchmarks/timeline.py reads back."""
    from vllm_ext.exchange import timeline
    from vllm_ext.exchange.gpu_watchdog import Retired

    class Clock:  # GPU events on the host's clock, without a GPU
        def host_time(self, event: Any) -> float:
            return event.at

    class Event:
        def __init__(self, at: float) -> None:
            self.event = self
            self.at = at

    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    monkeypatch.setattr(timeline, "GpuClock", Clock)
    line = timeline.Timeline("attention", 0)
    retired = Retired(7, 0.002, 0.0004, 16, 0, 101.0, 100.5, Event(100.6), Event(100.9),
                      control_at=100.25)  # fmt: skip
    line.step(retired)
    line.close()
    (path,) = tmp_path.glob("attention-0-*.jsonl")
    assert json.loads(path.read_text()) == {
        "step": 7, "rows": 16, "host_open": 100.4996, "host_enqueued": 100.5,
        "host_control": 100.25, "gpu_start": 100.6, "gpu_end": 100.9, "host_tokens": 0.0,
    }  # fmt: skip


def test_a_sampled_timeline_keeps_runs_of_neighbouring_steps(tmp_path, monkeypatch) -> None:
    """AFD_TIMELINE_EVERY=N: lines only for steps k, k+1 and k+2 of every N (the period, idle
    and next-open figures need a step's neighbours), the same steps on both sides (they share
    step ids); an attention line carries its step's verdict time, whichever comes first."""
    from vllm_ext.exchange import timeline
    from vllm_ext.exchange.gpu_watchdog import Retired

    class Clock:
        def host_time(self, event: Any) -> float:
            return event.at

    class Event:
        def __init__(self, at: float) -> None:
            self.at = at

    def retired(step_id: int) -> Retired:
        return Retired(step_id, 0.001, 0.0, 4, 0, 1.0, 0.5, Event(0.6), Event(0.9))

    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    monkeypatch.setenv(timeline.EVERY_ENV, "8")
    monkeypatch.setattr(timeline, "GpuClock", Clock)
    ffn = timeline.Timeline("ffn", 0)
    attention = timeline.Timeline("attention", 0, verdicts=True)
    for step_id in range(1, 20):
        ffn.step(retired(step_id))
        if step_id % 2:  # the verdict before the step's retirement is reported, or after it
            attention.tokens(step_id, 2.0 + step_id)
            attention.step(retired(step_id))
        else:
            attention.step(retired(step_id))
            attention.tokens(step_id, 2.0 + step_id)
    attention.step(retired(24))  # no verdict asked before close: written without one
    ffn.close()
    attention.close()

    def rows(role: str) -> list[dict[str, Any]]:
        (path,) = tmp_path.glob(f"{role}-0-*.jsonl")
        return [json.loads(row) for row in path.read_text().splitlines()]

    assert [r["step"] for r in rows("ffn")] == [1, 2, 8, 9, 10, 16, 17, 18]
    tokens = {r["step"]: r["host_tokens"] for r in rows("attention")}
    assert tokens == {1: 3.0, 2: 4.0, 8: 10.0, 9: 11.0, 10: 12.0, 16: 18.0, 17: 19.0, 18: 20.0,
                      24: 0.0}  # fmt: skip


def test_kept_logs_carry_the_timelines(tmp_path) -> None:
    """--log-dir keeps each run's process logs and its AFD parts' timeline files together."""
    import argparse

    from benchmarks.e2e_interleaved import keep_logs

    run = tmp_path / "run"
    (run / "timeline" / "afd").mkdir(parents=True)
    (run / "afd-2.log").write_text("log\n")
    (run / "timeline" / "afd" / "attention-0-1.jsonl").write_text("{}\n")
    keep_logs(argparse.Namespace(log_dir=str(tmp_path / "kept")), run, "colocated+afd@2")
    kept = tmp_path / "kept" / "colocated_afd_depth2"
    assert (kept / "afd-2.log").read_text() == "log\n"
    assert (kept / "timeline" / "afd" / "attention-0-1.jsonl").read_text() == "{}\n"


def test_a_noisy_batch_size_gets_more_repeats_until_its_interval_is_narrow() -> None:
    """Issue 33 item 5: noise is measured (more repeats where an interval is wide), a quiet
    batch size keeps its repeats, and the extra rounds stop at their bound."""
    from benchmarks.interleave import More, interleave

    class Engine:
        """A part whose TPOT at batch 256 alternates wildly for its first repeats, then
        settles; at batch 16 it is steady."""

        def __init__(self, name: str, base: float) -> None:
            self.name, self.base, self.runs = name, base, []

        def run(self, batch: int, repeat: int, timeout_s: float) -> float:
            self.runs.append((batch, repeat))
            if batch == 256 and repeat < 4:
                return self.base * (3.0 if repeat % 2 else 0.5)
            return self.base

    parts = [Engine("colocated", 2.0), Engine("afd", 2.2)]
    more = More(bound=0.25, max_repeats=30, budget_s=60.0)
    tpot = interleave(parts, [16, 256], repeats=5, timeout_s=1.0, more=more)
    assert len(tpot["afd"][16]) == 5  # narrow from the start: no repeat more
    assert 5 < len(tpot["afd"][256]) < 30  # more until narrow, not up to the cap
    assert not more.wide(tpot)
    # Turns alternate in the extra rounds too, and both parts ran every repeat.
    assert [r for b, r in parts[0].runs if b == 256] == list(range(len(tpot["afd"][256])))
    # A batch size that never settles stops at max_repeats (then the summary refuses it).
    tpot = interleave(parts, [256], repeats=3, timeout_s=1.0, more=More(0.0, 7, 60.0))
    assert len(tpot["afd"][256]) == 7
    # No budget left: no extra round.
    tpot = interleave(parts, [256], repeats=3, timeout_s=1.0, more=More(0.0, 7, -1.0))
    assert len(tpot["afd"][256]) == 3


def test_thread_clock_names_each_threads_cpu_per_step() -> None:
    """Issue 33: where a process's CPU goes per step, thread by thread, without sampling: a
    busy AFD-named thread shows its CPU under its own name, an idle one does not."""
    import os
    import threading

    from afd_ctl.threads import named_thread
    from benchmarks import thread_clock

    if not os.path.exists(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc: Linux only")
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    busy = named_thread(spin, "afd-test-busy")
    idle = named_thread(stop.wait, "afd-test-idle", (30.0,))
    busy.start()
    idle.start()
    try:
        labels = thread_clock.tree_labels(os.getpid())
        before = thread_clock.snapshot(labels)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # until the spinning thread has had 50 ms of CPU
            after = thread_clock.snapshot(labels)
            if (
                after.get("runner:afd-test-busy", (0, 0, 0))[0]
                - before.get("runner:afd-test-busy", (0, 0, 0))[0]
                > 50e6
            ):
                break
            stop.wait(0.01)
        per = thread_clock.per_step(before, after, steps=10)
    finally:
        stop.set()
        busy.join(5.0)
        idle.join(5.0)
    assert per["runner:afd-test-busy"]["cpu_us"] >= 5000  # 50 ms over 10 steps
    assert "runner:afd-test-idle" not in per  # under the floor
    assert all(key.startswith("runner:") for key in per)
    median = thread_clock.median_per_step([per, {}, per])
    assert median["runner:afd-test-busy"] == per["runner:afd-test-busy"]


def test_host_call_cost_names_each_calls_cost_on_this_host() -> None:
    """benchmarks/host_call_cost.py: one JSON line, every row a positive median (CPU rows here;
    the CUDA rows need a GPU)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "benchmarks/host_call_cost.py", "--calls", "200", "--mps", "off"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "host_call_cost" and result["mps"] is False
    rows = {**result["python"], "thread_hand_over": result["thread_hand_over"],
            "to_sleeper": result["datagram_send_to_a_sleeping_process"]}  # fmt: skip
    assert {"step_to_payload", "datagram_send_and_receive", "thread_hand_over"} <= set(rows)
    assert all(0 < row["median_us"] <= row["p90_us"] for row in rows.values())


def test_attention_host_step_runs_the_step_machine_against_a_real_daemon() -> None:
    """benchmarks/attention_host_step.py: the GPU-driven path's host side on CPU, one JSON
    line with AFD's time per step and its parts, every payload published (several a message
    in the coalescing window)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "benchmarks/attention_host_step.py", "--steps", "300", "--block", "100",
         "--busy-us", "200", "--wait-us", "200", "--profile", "5"],
        capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "attention_host_step"
    assert len(result["afd_us_per_step_blocks"]) == 2  # the first block warms up
    assert result["afd_us_per_step"] > 0
    assert result["afd_host_us_per_step_median"] > 0 and result["settle_us_per_step"] > 0
    assert result["publish_payloads_per_message"] > 1
    assert len(result["top_own_us_per_step"]) == 5
