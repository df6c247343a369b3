"""The accuracy gate's logic (vllm_ext.testing.accuracy_gate), its fault injection
(vllm_ext.testing.faults) and the float32 reduction of expert-split partial outputs
(afd_data.partial_sums), without vLLM. The gate on real vLLM runs: test_vllm_accuracy_gate.py."""

from __future__ import annotations

import pytest
import torch

from afd_data.partial_sums import sum_partials
from vllm_ext.testing import accuracy_gate as gate
from vllm_ext.testing import faults

pytestmark = pytest.mark.line_independent


def _run(logprobs: list[list[float]], top1: list[list[int]], generated=None) -> dict:
    scored = [[5] * len(lp) for lp in logprobs]
    return {
        "scored": scored,
        "generated": generated or scored,
        "logprobs": logprobs,
        "top1": top1,
    }


def test_prompts_are_deterministic_varied_and_avoid_bos_eos() -> None:
    prompts = gate.prompt_token_ids(32, 512, min_len=4, max_len=128)
    assert prompts == gate.prompt_token_ids(32, 512, min_len=4, max_len=128)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 4 and lengths[-1] == 128 and len(set(lengths)) == 32
    assert all(2 <= t < 512 for p in prompts for t in p)


def test_identical_runs_have_zero_deltas_and_full_agreement() -> None:
    ref = _run([[-1.0, -2.0, -0.5]], [[3, 4, 5]])
    stats = gate.compare(ref, ref)
    assert (stats.median_abs_dlogprob, stats.p99_abs_dlogprob, stats.max_abs_dlogprob) == (0, 0, 0)
    assert stats.top1_agreement_pct == 100.0 and stats.first_divergence == [None]
    # Bit-identical envelope: the floors keep the gate passable by last-bit differences.
    slightly = _run([[-1.0 + 1e-6, -2.0, -0.5]], [[3, 4, 5]])
    assert gate.verdict(gate.compare(ref, slightly), stats).passed


def test_statistics_and_divergence() -> None:
    ref = _run([[0.0] * 100], [list(range(100))], generated=[[1, 2, 3, 4]])
    other = _run(
        [[0.01 * i for i in range(100)]],
        [list(range(98)) + [0, 0]],
        generated=[[1, 2, 9, 4]],
    )
    other["scored"] = ref["scored"]
    stats = gate.compare(ref, other)
    assert stats.median_abs_dlogprob == pytest.approx(0.495)
    assert stats.p99_abs_dlogprob == pytest.approx(0.9801)
    assert stats.max_abs_dlogprob == pytest.approx(0.99)
    assert stats.top1_agreement_pct == pytest.approx(98.0)
    assert stats.first_divergence == [2] and stats.to_json()["earliest_divergence"] == 2


def test_runs_that_scored_different_tokens_are_refused() -> None:
    ref = _run([[0.0]], [[1]])
    other = _run([[0.0]], [[1]])
    other["scored"] = [[6]]
    with pytest.raises(ValueError, match="different continuations"):
        gate.compare(ref, other)


def test_the_verdict_follows_the_envelope() -> None:
    envelope = gate.Stats(100, 0.01, 0.1, 0.3, 99.0, [None])

    def stats(median: float, p99: float, top1: float) -> gate.Stats:
        return gate.Stats(100, median, p99, 1.0, top1, [None])

    assert gate.verdict(stats(0.015, 0.15, 98.5), envelope).passed
    failed = gate.verdict(stats(0.016, 0.16, 98.4), envelope)
    assert not failed.passed and len(failed.reasons) == 3, failed.reasons
    assert failed.to_json()["accuracy_gate"] == "fail"
    # An all-zero envelope: the floors, not zero, bound the deltas.
    zero = gate.Stats(100, 0.0, 0.0, 0.0, 100.0, [None])
    assert gate.verdict(stats(gate.MEDIAN_FLOOR, gate.P99_FLOOR, 99.5), zero).passed
    assert not gate.verdict(stats(0.0, 2 * gate.P99_FLOOR, 100.0), zero).passed


def test_the_faults_touch_one_layer_only() -> None:
    def forward(layer: int, hidden: torch.Tensor, *rest: object) -> torch.Tensor:
        return hidden * 2

    faulty = faults.with_fault(forward, "swap_rows:1")
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(faulty(0, x), x * 2)
    assert torch.equal(faulty(1, x), (x * 2)[[1, 0, 2]])
    assert torch.equal(faulty(1, x[:1]), x[:1] * 2)  # one row: nothing to swap
    assert torch.equal(faults.with_fault(forward, "swap_rows:1:0:2")(1, x), (x * 2)[[2, 1, 0]])
    assert torch.equal(faults.with_fault(forward, "shift_rows:1")(1, x), (x * 2)[[2, 0, 1]])
    for bad in ("swap_rows", "drop:1", "swap_rows:1:2", "swap_rows:0:1:1", "shift_rows:1:2"):
        with pytest.raises(ValueError, match=faults.ENV):
            faults.parse(bad)


def test_an_armed_fault_waits_for_its_file(tmp_path) -> None:
    """AFD_FAULT_ARMED_BY: faithful outputs until the file exists, the fault from then on."""

    def forward(layer: int, hidden: torch.Tensor, *rest: object) -> torch.Tensor:
        return hidden * 2

    arm = tmp_path / "arm"
    faulty = faults.with_fault(forward, "shift_rows:1", str(arm))
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(faulty(1, x), x * 2)
    arm.touch()
    assert torch.equal(faulty(1, x), (x * 2)[[2, 0, 1]])
    assert torch.equal(faulty(0, x), x * 2)  # still one layer only


def test_partial_outputs_are_summed_in_float32_and_rounded_once() -> None:
    torch.manual_seed(0)
    parts = [torch.randn(64, 256).to(torch.bfloat16) for _ in range(2)]
    exact = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    assert torch.equal(sum_partials(torch.empty_like(parts[0]), parts), exact)
    one = sum_partials(torch.empty_like(parts[0]), parts[:1])
    assert torch.equal(one, parts[0]) and one.data_ptr() != parts[0].data_ptr()
    wide = [p.float() for p in parts]
    before = wide[0].clone()
    assert torch.equal(sum_partials(torch.empty_like(wide[0]), wide), wide[0] + wide[1])
    assert torch.equal(wide[0], before)  # the received partial output is left as it was
    # Three bf16 partials: summing in bf16 would round twice.
    parts.append(torch.randn(64, 256).to(torch.bfloat16))
    want = (parts[0].float() + parts[1].float() + parts[2].float()).to(torch.bfloat16)
    assert torch.equal(sum_partials(torch.empty_like(parts[0]), parts), want)


def test_position_scores_read_offline_and_http_prompt_logprobs() -> None:
    class Logprob:  # vLLM's offline entries: attributes
        def __init__(self, logprob: float, rank: int) -> None:
            self.logprob, self.rank = logprob, rank

    offline = [{7: Logprob(-0.1, 1)}, {8: Logprob(-2.0, 3), 9: Logprob(-0.5, 1)}]
    http = [{"7": {"logprob": -0.1, "rank": 1}},
            {"8": {"logprob": -2.0, "rank": 3}, "9": {"logprob": -0.5, "rank": 1}}]  # fmt: skip
    for positions in (offline, http):
        assert gate.position_scores(positions, [7, 8]) == ([-0.1, -2.0], [7, 9])
