"""Seam: `vllm/v1/engine/core.py` `EngineCore` (step, step_with_batch_queue,
execute_dummy_batch, shutdown) and the busy loops of `EngineCoreProc`/`DPEngineCoreProc`.

Why: vLLM has no per-request failure path from a worker: an exception in a step ends the
engine core and with it the API server. AFD fails the running requests instead
(vllm_ext.attention.step_failures) and asks its workers to publish `stop` while they are still alive
(before vLLM's SIGTERM handling kills them).
Upstream change that makes it unnecessary: a worker-side "step failed, fail these requests"
result that the engine core handles without exiting, and a plugin hook at engine shutdown.
Remove when: every supported line has both.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.v1.engine.core", "EngineCore.shutdown", ("self",)),
    ("vllm.v1.engine.core", "EngineCore.step", ("self",)),
    ("vllm.v1.engine.core", "EngineCore.step_with_batch_queue", ("self",)),
    ("vllm.v1.engine.core", "EngineCore.execute_dummy_batch", ("self",)),
    ("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", ("self",)),
    ("vllm.v1.engine.core", "DPEngineCoreProc.run_busy_loop", ("self",)),
    ("vllm.v1.engine", "EngineCoreOutput", ()),
    ("vllm.v1.engine", "EngineCoreOutputs", ()),
    ("vllm.v1.request", "RequestStatus.FINISHED_ERROR", ()),
    # They log a failed start with its exception on STARTUP_FAILURE_LOGGER (below).
    ("vllm.v1.executor.multiproc_executor", "WorkerProc.worker_main", ()),
    ("vllm.v1.engine.core", "EngineCoreProc.run_engine_core", ()),
]

# vLLM's logger. A worker or engine core that fails to start logs its exception there
# ("WorkerProc failed to start.", "EngineCore failed to start.", with exc_info) and hands the
# API server only "Engine core initialization failed. See root cause above."; the plugin loads
# in those processes after vLLM configured its logging, so a handler added then stays
# (vllm_ext.startup_errors reads the exception from it).
STARTUP_FAILURE_LOGGER = "vllm"
# What those two log records say (only start-up failures: a failed step later is not one).
STARTUP_FAILURE_PHRASE = "failed to start"


def loaded_engine_core_module() -> Any:
    """vllm/v1/engine/core.py, only in engine-core processes (they load plugins from
    EngineCore.__init__): EngineCore.step/step_with_batch_queue/execute_dummy_batch/shutdown
    and the busy loops of EngineCoreProc/DPEngineCoreProc."""
    return sys.modules.get("vllm.v1.engine.core")


def finish_requests_with_error(scheduler: Any, request_ids: list[str]) -> list[Any]:
    """The scheduler's own way of ending requests (vllm/v1/core/sched/scheduler.py)."""
    from vllm.v1.request import RequestStatus

    return list(scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR))


def engine_core_outputs_classes() -> tuple[Any, Any]:
    """(EngineCoreOutput, EngineCoreOutputs): what EngineCore.step returns per client."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    return EngineCoreOutput, EngineCoreOutputs


_PATCHED = "_afd_wrapped"


def patch_engine_core(
    before_shutdown: Callable[[Any], None],
    wrap_step: Callable[[Any], Any],
    wrap_dummy_batch: Callable[[Any], Any],
) -> None:
    """In an engine-core process (it loads plugins from EngineCore.__init__), once:
    `EngineCore.shutdown` first calls before_shutdown(engine_core), and so does the end of
    `EngineCoreProc.run_busy_loop` / `DPEngineCoreProc.run_busy_loop` (while vLLM's SIGTERM
    handler is still installed); `step` and `step_with_batch_queue` become wrap_step(method),
    `execute_dummy_batch` wrap_dummy_batch(method)."""
    core = loaded_engine_core_module()
    if core is None:
        return
    engine_core_cls = core.EngineCore
    if getattr(engine_core_cls.shutdown, _PATCHED, False):
        return
    original_shutdown = engine_core_cls.shutdown

    def shutdown(self: Any) -> Any:
        before_shutdown(self)
        return original_shutdown(self)

    setattr(shutdown, _PATCHED, True)
    engine_core_cls.shutdown = shutdown
    for name in ("step", "step_with_batch_queue"):
        setattr(engine_core_cls, name, wrap_step(getattr(engine_core_cls, name)))
    engine_core_cls.execute_dummy_batch = wrap_dummy_batch(engine_core_cls.execute_dummy_batch)
    for name in ("EngineCoreProc", "DPEngineCoreProc"):
        cls = getattr(core, name, None)
        if cls is not None and "run_busy_loop" in vars(cls):
            cls.run_busy_loop = _then(vars(cls)["run_busy_loop"], before_shutdown)


def _then(run_busy_loop: Any, after: Callable[[Any], None]) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run_busy_loop(self, *args, **kwargs)
        finally:
            after(self)

    return wrapped


# The tuple EngineCore.step_with_batch_queue queues per batch (tests/test_vllm_compat.py
# checks vLLM's source still builds it so).
BATCH_QUEUE_ENTRY = "batch_queue.appendleft((future, scheduler_output, exec_future))"


def queued_batch_futures(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """The futures of one batch_queue entry, (future, scheduler_output, exec_future) on both
    lines: what a failed step waits for before it fails the running requests."""
    return entry[::2]
