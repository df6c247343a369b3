"""A failing AFD step writes one line, not vLLM's traceback and engine dump each time (issue
22, item 2): the filters vllm_ext.attention.failure_logs puts on vLLM's two loggers, driven with the
records vLLM writes (no vLLM needed), on a fake clock."""

from __future__ import annotations

import logging

import pytest

from vllm_ext.attention import failure_logs
from vllm_ext.attention.step_failures import AfdStepFailed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(failure_logs.time, "monotonic", fake)
    return fake


def worker_record(error: BaseException) -> logging.LogRecord:
    """What vLLM's WorkerProc logs: logger.exception("WorkerProc hit an exception.")."""
    return logging.LogRecord(
        failure_logs.WORKER_LOGGER, logging.ERROR, __file__, 1,
        "WorkerProc hit an exception.", None, (type(error), error, None),
    )  # fmt: skip


def record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)


def lost(step: int, layer: int) -> AfdStepFailed:
    return AfdStepFailed(
        f"step {step}, layer {layer}: afd peer lost: ffn rank 0 was reported lost by the "
        f"control plane; now epoch {1796139776690 + step}"
    )


def test_one_traceback_per_cause_then_one_a_minute(clock: Clock) -> None:
    repeat = failure_logs.RepeatFilter()
    passed = [repeat.filter(worker_record(lost(step, step % 4))) for step in range(1, 201)]
    assert passed[0] and sum(passed) == 1  # 200 failed steps of one outage: one traceback
    other = AfdStepFailed("step 201: not ready: the expected set is incomplete")
    assert repeat.filter(worker_record(other))  # a new cause: its traceback too
    assert not repeat.filter(worker_record(other))
    assert repeat.filter(worker_record(RuntimeError("not AFD")))  # anything else: untouched
    assert repeat.filter(record(failure_logs.WORKER_LOGGER, "WorkerProc failed to start."))
    clock.now += 61
    again = worker_record(lost(300, 1))
    assert repeat.filter(again)  # a minute on: one more, saying how many were dropped
    # One `other` was dropped since the last traceback shown (the new cause's).
    assert "(1 more like it not logged)" in again.getMessage()


def test_engine_dumps_after_an_afd_failure_are_kept_to_one_a_minute(clock: Clock) -> None:
    dump = failure_logs.DumpFilter()
    arming = failure_logs._Arming(dump)

    def engine_dump() -> list[bool]:
        return [
            dump.filter(record(failure_logs.DUMP_LOGGER, what))
            for what in ("Dumping input data ...", "Dumping scheduler output", "stats")
        ]

    assert engine_dump() == [True, True, True]  # the first failure's dump, whole
    arming.filter(record(failure_logs.STEP_LOGGER, "afd: AFD step failed: step 3: lost"))
    for _ in range(25):  # 50 s of failing steps
        clock.now += 2
        assert engine_dump() == [False, False, False]
        arming.filter(record(failure_logs.STEP_LOGGER, "afd: AFD step failed: step 4: lost"))
    clock.now += 61
    assert engine_dump() == [True, True, True]  # a minute on: one whole dump


def test_without_afd_failures_vllm_dumps_as_it_does(clock: Clock) -> None:
    dump = failure_logs.DumpFilter()
    for _ in range(3):
        clock.now += 5
        assert dump.filter(record(failure_logs.DUMP_LOGGER, "Dumping input data ..."))
