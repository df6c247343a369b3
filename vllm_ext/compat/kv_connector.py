"""Seam: vLLM's KV connector lifecycle in the V1 runner (`vllm/v1/worker/
kv_connector_model_runner_mixin.py` `KVConnectorModelRunnerMixin._get_kv_connector_output` and
`kv_connector_no_forward`), for an AFD attention server that is a KV consumer (prefill/decode
disaggregation: `--kv-transfer-config` on the attention server).

Why: each step, vLLM's runner binds the step's connector metadata, starts the KV loads the
scheduler planned (requests waiting for a prefill server's KV), and collects the transfers that
finished; the scheduler hears of them only through that step's output. A failed AFD step
(its FFN side is down) raises out of execute_model instead of returning an output: the
transfers that finished in it were reported to nobody, and a step that failed while it opened
(before vLLM reached its KV work) never even started its loads. Either way a request would wait
for its remote KV forever, holding its KV blocks. So: what a failed step's KV work found is
kept and handed to the scheduler with the next step's output, and a step that failed before
its KV work runs it (vLLM's own no-forward path) before the failure goes up.
Upstream change that makes it unnecessary: a runner that reports a step's KV connector output
also when the step raises (or a per-request failure result from the worker).
Remove when: every supported line has it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

MIXIN = "vllm.v1.worker.kv_connector_model_runner_mixin"

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    (MIXIN, "KVConnectorModelRunnerMixin._get_kv_connector_output", ("scheduler_output",)),
    (
        MIXIN,
        "KVConnectorModelRunnerMixin.kv_connector_no_forward",
        ("scheduler_output", "vllm_config"),
    ),
    ("vllm.distributed.kv_transfer", "has_kv_transfer_group", ()),
    (
        "vllm.v1.outputs",
        "KVConnectorOutput.__init__",
        ("finished_sending", "finished_recving", "invalid_block_ids"),
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", ("scheduler_output",)),
]

# The request and block ids a KV connector output reports (failed_recving: 0.32 only).
_ID_SETS = ("finished_sending", "finished_recving", "invalid_block_ids", "failed_recving")
# What else it carries: the newest wins, an older one fills a gap.
_LATEST = ("kv_connector_stats", "kv_cache_events", "kv_connector_worker_meta")

_PATCHED = "_afd_wrapped"


class _Lifecycle:
    """This worker process's record of vLLM's KV connector work (one runner per process)."""

    def __init__(self) -> None:
        self.ran_for: Any = None  # the SchedulerOutput whose KV work ran last
        self.stranded: Any = None  # a failed step's KV connector output, not delivered yet
        self._lock = threading.Lock()

    def strand(self, output: Any) -> None:
        if output is None:
            return
        with self._lock:  # a GPU-driven step's verdict fails on vLLM's async output thread
            self.stranded = output if self.stranded is None else merged(self.stranded, output)

    def deliver_into(self, output: Any) -> None:
        with self._lock:
            kept, self.stranded = self.stranded, None
        if kept is None:
            return
        fold_into(output, kept)
        log.info("afd: a failed step's KV transfer results go to the scheduler now (%s)", kept)


LIFECYCLE = _Lifecycle()


def merged(older: Any, newer: Any) -> Any:
    fold_into(newer, older)
    return newer


def fold_into(output: Any, older: Any) -> None:
    """Adds `older`'s request and block ids to `output` (a KVConnectorOutput)."""
    for name in _ID_SETS:
        old = getattr(older, name, None)
        if not old:
            continue
        setattr(output, name, set(getattr(output, name, None) or ()) | set(old))
    for name in _LATEST:
        if getattr(output, name, None) is None and getattr(older, name, None) is not None:
            setattr(output, name, getattr(older, name))


def watch_kv_connector_lifecycle() -> None:
    """Wraps KVConnectorModelRunnerMixin._get_kv_connector_output once (idempotent): it
    records which step's KV work ran, keeps the output of a step that raised, and adds what
    a failed step kept to the next output. Unchanged behaviour while no step fails."""
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    original = KVConnectorModelRunnerMixin._get_kv_connector_output
    if getattr(original, _PATCHED, False):
        return

    @contextlib.contextmanager
    def kept_on_failure(scheduler_output: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        LIFECYCLE.ran_for = scheduler_output
        inner = original(scheduler_output, *args, **kwargs)
        output = inner.__enter__()
        try:
            yield output
        except BaseException as exc:
            # vLLM's own exit fills `output` (finished transfers, failed loads), then re-raises.
            if not inner.__exit__(type(exc), exc, exc.__traceback__):
                LIFECYCLE.strand(output)
                raise
        else:
            inner.__exit__(None, None, None)
            LIFECYCLE.deliver_into(output)

    setattr(kept_on_failure, _PATCHED, True)
    KVConnectorModelRunnerMixin._get_kv_connector_output = staticmethod(kept_on_failure)


def settle_failed_step(scheduler_output: Any, vllm_config: Any) -> None:
    """After execute_model raised: if the step's KV work never ran (it failed while opening),
    runs it as vLLM does for a step with nothing to compute (its loads start) and keeps its
    output for the next step. Never raises: the step's own failure is what goes up."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    if not has_kv_transfer_group() or LIFECYCLE.ran_for is scheduler_output:
        return
    if getattr(scheduler_output, "kv_connector_metadata", None) is None:
        return
    try:
        result = KVConnectorModelRunnerMixin.kv_connector_no_forward(scheduler_output, vllm_config)
    except Exception as exc:  # the failed step is reported either way
        log.warning("afd: the failed step's KV connector work could not run: %s", exc)
        return
    output = getattr(result, "kv_connector_output", None)
    if output is not None:
        LIFECYCLE.strand(output)
