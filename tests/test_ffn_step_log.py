"""What an FFN worker's log says of the steps it served: the first few and any slow one with
where its time went (a peer's "no outputs within" error is then explained by the FFN's own
log: a step that waited for rows, or one that computed for seconds), the rest only every
thousandth."""

from __future__ import annotations

import logging

import pytest

from afd_ctl.step import Step
from vllm_ext.exchange.base import StepSplit
from vllm_ext.ffn import steps as ffn_steps
from vllm_ext.ffn.steps import FfnSteps
from vllm_ext.metrics import FfnMetrics


class _TimedExchange:
    """The FfnExchange seam with each step's host time given (what run_step measured)."""

    path = "NIXL"

    def __init__(self, splits: list[StepSplit]) -> None:
        self._splits = iter(splits)

    def run_step(self, step: Step, received_at: float) -> StepSplit:
        return next(self._splits)


def test_first_and_slow_steps_are_logged_with_their_split(
    caplog: pytest.LogCaptureFixture,
) -> None:
    quick = StepSplit(recv_s=0.001, compute_s=0.002, send_s=0.0005)
    slow = StepSplit(recv_s=0.001, compute_s=ffn_steps.SLOW_STEP_S + 2.5, send_s=0.0)
    splits = [quick] * (ffn_steps.FIRST_STEPS_LOGGED + 3) + [slow, quick]
    exchange = _TimedExchange(splits)
    steps = FfnSteps(graphs=False, worker_id="ffn-0")
    with caplog.at_level(logging.INFO, logger=ffn_steps.__name__):
        for step_id in range(1, len(splits) + 1):
            payload = Step.of(step_id, [[3, 5]]).to_payload()
            steps.run(payload, exchange, FfnMetrics(None), profiler=None)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    served = [int(line.split(" steps served (last ")[1].split(",")[0]) for line in lines]
    assert served == [*range(1, ffn_steps.FIRST_STEPS_LOGGED + 1), len(splits) - 1], lines
    assert "8 rows, NIXL: waited 0.001 s, computed 0.002 s" in lines[0], lines
    assert lines[-1].endswith("computed 3.500 s, sent 0.000 s) (a slow step)"), lines
    assert steps.stats()["steps"] == len(splits)
