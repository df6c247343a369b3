"""A failed AFD step fails its requests, not the attention server.

When the FFN side dies or is not back yet, the attention worker's step raises AfdStepFailed
(from the data plane within milliseconds of a kill, from afd-ctl within its liveness bound).
vLLM would let that exception end the engine core, and with it the API server. Instead, the
engine core (`fail_step` around `EngineCore.step`) finishes every running request with
FinishReason.ERROR, which the API server turns into an error response for those requests only.

Then the prefix cache is reset: vLLM marks a step's KV blocks as cached when it schedules them,
so blocks of a step that never finished would otherwise be served as valid prefixes to the
next request with the same prompt.

The next step reconnects to the newest complete view afd-ctl has (AttentionSession) or fails
at once; `/health` answers 503 meanwhile (vllm_ext.attention.health).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

from afd_ctl.errors import AfdError
from afd_data.errors import AfdBadInput, AfdDataError

log = logging.getLogger(__name__)

MARK = "AFD step failed"
# The stop_reason of a request this module failed: the API process tells an AFD failure (a 503
# that names the FFN side, /health held at 503) from any other error of a request (a KV cache
# that could not be read from a prefill server is vLLM's own error and leaves /health alone).
AFD_STOP_REASON = "afd_step_failed"


class AfdStepFailed(RuntimeError):
    """One step could not run its FFN layers; the engine fails the step's requests."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{MARK}: {detail}")

    @classmethod
    def reraise_short(cls, exc: AfdStepFailed) -> AfdStepFailed:
        """The same failure without the model's stack (vLLM's worker process logs every
        exception with its traceback: a hundred lines per failed step otherwise)."""
        short = cls.__new__(cls)
        RuntimeError.__init__(short, *exc.args)
        return short


def is_step_failure(exc: BaseException) -> bool:
    """True for AfdStepFailed, also when a multiprocess executor re-raised it as text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, AfdStepFailed) or MARK in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def fail_running_requests(engine_core: Any, exc: BaseException) -> dict[int, Any]:
    """Finishes every running request with an error; returns the engine core outputs that
    tell the API server so (one EngineCoreOutputs per client)."""
    from vllm_ext import compat

    seams = compat.seams()
    EngineCoreOutput, EngineCoreOutputs = seams.engine_core_outputs_classes()  # noqa: N806
    scheduler = engine_core.scheduler
    running = [r.request_id for r in scheduler.running]
    failed = seams.finish_requests_with_error(scheduler, running)
    per_client: dict[int, list[Any]] = defaultdict(list)
    for request in failed:
        per_client[request.client_index].append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                stop_reason=AFD_STOP_REASON,
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
        )
    log.error(
        "afd: %s; failed %d running request(s), the server stays up", _first_line(exc), len(failed)
    )
    outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in per_client.items()}
    # As update_from_output does: tell the front end (and the DP load balancer) which requests
    # finished, so its in-flight counts do not stay high while the FFN side is down.
    finished = getattr(scheduler, "finished_req_ids_dict", None)
    if finished:
        for client, ids in finished.items():
            outputs.setdefault(client, EngineCoreOutputs()).finished_requests = ids
        finished.clear()
    engine_core._afd_prefix_reset_pending = True
    reset_prefix_cache_if_pending(engine_core)
    return outputs


def reset_prefix_cache_if_pending(engine_core: Any) -> None:
    """After a failed step, until it succeeds (it needs every KV block free): the blocks that
    step scheduled were marked cached but never written."""
    if not getattr(engine_core, "_afd_prefix_reset_pending", False):
        return
    if engine_core.scheduler.reset_prefix_cache():
        engine_core._afd_prefix_reset_pending = False
        log.info("afd: prefix cache reset after the failed step")
    else:
        log.warning("afd: prefix cache not reset yet (blocks still in use); retrying each step")


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    start = text.find(MARK)
    return (text[start:] if start >= 0 else text).splitlines()[0]


def fail_step(step: Any) -> Any:
    """Wraps EngineCore.step and step_with_batch_queue: an AFD step failure fails the running
    requests. With a batch queue (async scheduling) the batches already submitted are
    collected first (they fail the same way, bounded by the step timeout)."""

    def wrapped(self: Any) -> tuple[dict[int, Any] | None, bool]:
        reset_prefix_cache_if_pending(self)
        try:
            return step(self)
        except Exception as exc:
            if not is_step_failure(exc):
                raise
            _drain_batch_queue(getattr(self, "batch_queue", None))
            return fail_running_requests(self, exc), True

    return wrapped


def _drain_batch_queue(batch_queue: Any) -> None:
    """Collects the batches already submitted (vLLM's executor futures take no timeout; vLLM
    bounds them with VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)."""
    from vllm_ext import compat

    while batch_queue:
        for future in compat.seams().queued_batch_futures(batch_queue.pop()):
            try:
                future.result()
            except Exception as exc:  # the same loss, most likely; its requests fail below
                log.debug("afd: queued batch after a failed step: %s", exc)


def skip_failed_dummy_batch(execute_dummy_batch: Any) -> Any:
    """Wraps EngineCore.execute_dummy_batch (attention DP: an idle rank's padding forward)."""

    def wrapped(self: Any) -> None:
        try:
            execute_dummy_batch(self)
        except Exception as exc:
            if not is_step_failure(exc):
                raise
            log.warning("afd: dummy batch skipped: %s", _first_line(exc))

    return wrapped


class failing_step:  # noqa: N801 (used as a function: `with failing_step(...)`)
    """AFD errors of a step become AfdStepFailed, which fails the step's requests only.

    Not `recoverable` under attention TP > 1: each TP rank would decide alone, one could leave
    the forward while the others wait in its all-reduce, so the error ends the engine.

    A class, not a generator: the runner enters three per step (open, close, verdict), and a
    generator-based context manager costs several times as much on its thread."""

    __slots__ = ("step_id", "layer", "recoverable", "on_failure")

    def __init__(
        self,
        step_id: int,
        layer: int | None = None,
        *,
        recoverable: bool = True,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.step_id, self.layer = step_id, layer
        self.recoverable, self.on_failure = recoverable, on_failure

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, AfdBadInput):  # a setting or an extension bug: every step alike
            raise RuntimeError(f"afd: step {self.step_id}: {exc}") from exc
        if not isinstance(exc, (AfdError, AfdDataError)):
            return False
        if self.on_failure is not None:
            self.on_failure(exc)
        where = f"step {self.step_id}" + (f", layer {self.layer}" if self.layer is not None else "")
        if not self.recoverable:
            raise RuntimeError(
                f"afd: {where}: {exc} (attention TP > 1: its TP ranks cannot fail a step "
                "together yet, so this ends the server)"
            ) from exc
        raise AfdStepFailed(f"{where}: {exc}") from exc


def failure_reason(exc: BaseException, *, controller_lost: bool) -> str:
    """The afd_failed_steps_total reason label of a failed step's exception."""
    from afd_ctl.errors import (
        AfdControllerUnreachable,
        AfdNotReady,
        AfdPeerLost,
        AfdRejected,
        AfdTimeout,
    )

    if isinstance(exc, AfdControllerUnreachable) or controller_lost:
        return "controller_unreachable"
    for kind, reason in (
        (AfdPeerLost, "peer_lost"),
        (AfdNotReady, "not_ready"),
        (AfdTimeout, "timeout"),
        (AfdRejected, "rejected"),
    ):
        if isinstance(exc, kind):
            return reason
    return "other"
