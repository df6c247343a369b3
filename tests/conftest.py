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
