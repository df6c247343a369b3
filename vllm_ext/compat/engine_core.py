"""Seam: `vllm/v1/engine/core.py` `EngineCore` (step, step_with_batch_queue,
execute_dummy_batch, shutdown) and the busy loops of `EngineCoreProc`/`DPEngineCoreProc`.

Why: vLLM has no per-request failure path from a worker: an exception in a step ends the
engine core and with it the API server. AFD fails the running requests instead
(vllm_ext.step_failures) and asks its workers to publish `stop` while they are still alive
(before vLLM's SIGTERM handling kills them).
Upstream change that makes it unnecessary: a worker-side "step failed, fail these requests"
result that the engine core handles without exiting, and a plugin hook at engine shutdown.
Remove when: every supported line has both.
"""

from __future__ import annotations

import sys
from types import ModuleType
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
]


def loaded_engine_core_module() -> ModuleType | None:
    """vllm/v1/engine/core.py, only in engine-core processes (they load plugins from
    EngineCore.__init__): EngineCore.step/step_with_batch_queue/execute_dummy_batch/shutdown
    and the busy loops of EngineCoreProc/DPEngineCoreProc."""
    return sys.modules.get("vllm.v1.engine.core")


def finish_requests_with_error(scheduler: Any, request_ids: list[str]) -> list[Any]:
    """The scheduler's own way of ending requests (vllm/v1/core/sched/scheduler.py)."""
    from vllm.v1.request import RequestStatus

    return list(scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR))


def engine_core_outputs_classes() -> tuple[type, type]:
    """(EngineCoreOutput, EngineCoreOutputs): what EngineCore.step returns per client."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    return EngineCoreOutput, EngineCoreOutputs
