from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.procs import Daemon, Proc

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[list[Proc]]:
    """Processes started by a test; all killed at teardown, their logs shown on failure."""
    started: list[Proc] = []
    yield started
    failed = getattr(request.node, "rep_call", None)
    for proc in started:
        if failed is not None and failed.failed:
            print(f"\n--- {' '.join(proc.argv[2:6])} (log {proc.log_path}) ---\n{proc.tail()}")
        proc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


@pytest.fixture
def start_daemon(procs: list[Proc], tmp_path: Path) -> Callable[..., Daemon]:
    counter = iter(range(1000))

    def start(*args: str, **kwargs: object) -> Daemon:
        daemon = Daemon(tmp_path / f"daemon-{next(counter)}.log", *args, **kwargs)  # type: ignore[arg-type]
        procs.append(daemon)
        return daemon

    return start


# `make test` runs each vLLM line's tests on pytest-xdist workers on machines of 4 cores or more
# (`--dist loadfile`, the Makefile's TEST_WORKERS): a module's tests stay on one worker (its
# module fixtures, e.g. one colocated server per module, start once). The heaviest modules are
# handed out first (make test passes --no-loadscope-reorder, so xdist keeps this order), so that
# no long module starts last while the other workers idle: seconds on vLLM 0.32, 2-core
# machine, 2026-12-03 (an order only; a module not listed goes after these, in its own order).
MODULE_SECONDS = {
    "test_vllm_afd": 193, "test_vllm_expert_parallel": 166, "test_vllm_serve": 156,
    "test_vllm_failures": 124, "test_multihost": 83, "test_vllm_accuracy_gate": 74,
    "test_vllm_pd": 61, "test_vllm_elastic": 45, "test_vllm_start_errors": 41,
    "test_control_load": 31, "test_vllm_daemon_restart": 30, "test_data_plane": 26,
    "test_vllm_plugin": 26, "test_install_script": 22, "test_vllm_security": 20,
    "test_vllm_metrics": 17, "test_control_failures": 15, "test_step_timings": 15,
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest modules first; stable, so each module's tests keep their order."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.stem, 0))
