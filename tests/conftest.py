from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.procs import Daemon, Proc

if TYPE_CHECKING:
    from tests.colocated_serve import ColocatedAnswers
    from tests.offline_references import Version

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


@pytest.fixture(scope="session")
def tiny_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V2 (random weights, seed 0) of the `vllm serve` tests, built once per
    session so that they share one colocated reference (`colocated_serve`)."""
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny-v2"), version=2)


@pytest.fixture(scope="session")
def tiny_models(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, tiny_v2: Path
) -> dict[Version, Path]:
    """The tiny model of each family (tests/offline_references.py runs vLLM's colocated
    reference of each), once per session for every module; DeepSeek-V2 is the `vllm serve`
    tests' (tiny_v2), so its reference run can answer for their colocated server."""
    from tests.offline_references import ask_beside_references
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek
    from vllm_ext.testing.tiny_qwen3_moe import build_tiny_qwen3_moe

    ask_beside_references(request.session.items)
    root = tmp_path_factory.mktemp("models")
    models: dict[Version, Path] = {2: tiny_v2, 3: build_tiny_deepseek(root / "tiny-v3", version=3)}
    models["qwen3"] = build_tiny_qwen3_moe(root / "tiny-qwen3-moe")
    return models


@pytest.fixture(scope="session")
def colocated_serve(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[Path], ColocatedAnswers]:
    """A colocated `vllm serve` of a model, started once per session (not per test or module:
    a start costs 25-40 s on 2 cores), asked every request of tests/colocated_serve.py, and
    stopped as soon as it has answered, before the asking test starts its attention servers
    (its FFN servers start beside it: once registered, they wait for those idle). Where this
    session's offline reference of the model ran first and answered those requests
    (tests/offline_references.py, the same engine in one process), those answers instead."""
    from tests.colocated_serve import answers_of
    from tests.offline_references import serve_answers
    from vllm_ext.testing.procs import free_port, serve_argv, vllm_env, wait_http_ok

    answers: dict[Path, ColocatedAnswers] = {}

    def of(model: Path) -> ColocatedAnswers:
        if model not in answers and (offline := serve_answers(model)) is not None:
            answers[model] = offline
        if model not in answers:
            port = free_port()
            log = tmp_path_factory.mktemp("colocated") / "colocated.log"
            # in_process: the engine core runs its worker itself (vLLM's uni executor) instead
            # of starting a worker process: the same answers, 6-20 s less of the 2 cores.
            server = Proc(serve_argv(model, port), log, vllm_env(in_process=True))
            try:
                wait_http_ok(f"http://127.0.0.1:{port}/health", 180, server.popen)
                answers[model] = answers_of(port, model)
            except BaseException:
                print(f"\n--- colocated vllm serve (log {log}) ---\n{server.tail()}")
                raise
            finally:
                server.stop()
        return answers[model]

    return of


# `make test` runs each vLLM line's tests on pytest-xdist workers, 0.32's from 4 cores and
# 0.26's from 2 (`--dist loadfile`, the Makefile's TEST_WORKERS and TEST_WORKERS_026): a
# module's tests stay on one worker (its module fixtures, e.g. one colocated server per module,
# start once). The heaviest modules are
# handed out first (make test passes --no-loadscope-reorder, so xdist keeps this order), so that
# no long module starts last while the other workers idle: seconds on vLLM 0.32, 2-core
# machine, 2026-12-03 (an order only; a module not listed goes after these, in its own order).
MODULE_SECONDS = {
    "test_vllm_afd": 193, "test_vllm_expert_parallel": 166, "test_vllm_serve": 156,
    "test_vllm_failures": 124, "test_multihost": 83, "test_vllm_accuracy_gate": 74,
    "test_vllm_pd": 61, "test_vllm_elastic": 45, "test_vllm_start_errors": 41,
    "test_control_load": 31, "test_data_plane": 26,
    "test_vllm_plugin": 26, "test_install_script": 22, "test_vllm_security": 20,
    "test_vllm_metrics": 46, "test_control_failures": 15, "test_step_timings": 15,
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest modules first; stable, so each module's tests keep their order."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.stem, 0))
