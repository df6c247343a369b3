"""The attention server's API process: `/health` and failed requests tell the truth about AFD.

- `GET /health` is 503 while afd-ctl does not report the expected set as SERVING (an FFN server
  is down, the daemon is draining or unreachable), and 200 again once it does. vLLM's route
  answers 503 only for EngineDeadError, so the AFD condition is raised as a subclass of it.
- A request that the engine finished with an error (vllm_ext.attention.step_failures) gets a 503 with
  what afd-ctl last said, instead of vLLM's bare "Internal server error". Only a request failed
  for an AFD step (its stop_reason says so): any other error (a KV cache a prefill server could
  not hand over, under prefill/decode disaggregation) stays vLLM's own and leaves /health be.
Each transition is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from afd_ctl.logs import RateLimitedLog
from vllm_ext.attention.step_failures import AFD_STOP_REASON

if TYPE_CHECKING:
    from vllm_ext.config import AfdConfig

log = logging.getLogger(__name__)
# Every request of a failing step fails: one line for the first, then one per 10 s with a count.
FAILED_REQUESTS = RateLimitedLog(log, "afd: request failed", interval_s=10.0)

# /health may be polled often: ask afd-ctl at most this often, and wait at most ASK_TIMEOUT_S.
CACHE_S = 0.5
ASK_TIMEOUT_S = 0.5
# A late answer (DEADLINE_EXCEEDED: afd-ctl's host is busy) is not a problem of the set: within
# this long of afd-ctl's last SERVING answer /health keeps it, so a load balancer does not take
# a healthy server out for one slow reply. Nothing listening (UNAVAILABLE), a refusal or a NOT
# SERVING answer still count at once; a loss reaches /health through the failed step anyway.
LATE_ANSWER_GRACE_S = 5.0
# After a request failed in the engine, /health is 503 until afd-ctl reports SERVING in a newer
# epoch (the set changed since: the FFN side is back), or at most this long (a loss only the
# data plane saw heals by a rejoin, which is a new epoch too).
FAILURE_HOLD_S = 10.0


class AfdFailedRequests:
    """The requests the engine failed for an AFD step, by the id the API server knows them by
    (vLLM's output processor sees them finish before the server builds the error reply)."""

    KEEP = 4096  # a reply not built (a client gone) must not grow this forever

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def seen(self, request_id: str, stop_reason: Any) -> None:
        if stop_reason != AFD_STOP_REASON:
            return
        self._ids[request_id] = None
        while len(self._ids) > self.KEEP:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Whether `request_id` (a completion's id covers its prompts, `ID-0`, `ID-1`...)
        failed for an AFD step; forgets it."""
        for known in self._ids:
            if known == request_id or known.startswith(request_id + "-"):
                del self._ids[known]
                return True
        return False


class AfdSideMonitor:
    """What afd-ctl says about the expected set, asked at most every CACHE_S."""

    def __init__(self, afd: AfdConfig) -> None:
        from vllm_ext.control import ControlAccess, StatusQuery

        access = ControlAccess.of(afd)
        self.controller = afd.controller
        self._query = StatusQuery(access)
        self._lock = threading.Lock()
        self._asked_at = float("-inf")
        self._problem: str | None = None
        self._reported: str | None = None
        self._epoch = 0  # of afd-ctl's last answer
        self._answered_at = float("-inf")  # when afd-ctl last answered SERVING
        # A request failed in the engine: when, and at which epoch (see FAILURE_HOLD_S).
        self._failed_at = float("-inf")
        self._failed_epoch = 0
        self.failed_requests = AfdFailedRequests()
        # Set while a planned change leaves this server out (vllm_ext.attention.leaving).
        self.leaving: str | None = None

    def note_failure(self) -> None:
        """A request failed in the engine: /health says so at once (not after the cached
        answer, or afd-ctl, catches up), and the next /health asks afd-ctl again. Runs on
        the API server's event loop, so it takes no lock (`problem` may hold it while it asks);
        plain assignments."""
        self._failed_at, self._failed_epoch = time.monotonic(), self._epoch
        self._asked_at = float("-inf")
        self._problem = self._failing(self._problem)

    def serving_age_s(self) -> float:
        """Seconds since afd-ctl last answered SERVING (inf: never)."""
        return time.monotonic() - self._answered_at

    def _failing(self, problem: str | None) -> str | None:
        """`problem`, or, while a failure is recent and afd-ctl has not moved past its epoch,
        that failure."""
        if problem is not None:
            return problem
        age = time.monotonic() - self._failed_at
        if age < FAILURE_HOLD_S and self._epoch <= self._failed_epoch:
            return (
                f"an AFD step failed {age:.1f} s ago and afd-ctl at {self.controller} still "
                f"reports SERVING at epoch {self._epoch} (a loss it has not seen yet, or only "
                "the data plane saw)"
            )
        return None

    @property
    def last_problem(self) -> str | None:
        """What afd-ctl said when last asked (no call: safe on the API server's event loop)."""
        return self._problem

    def problem(self) -> str | None:
        """None when afd-ctl reports SERVING, else why not (blocking, bounded)."""
        leaving = self.leaving
        if leaving is not None:
            return leaving
        with self._lock:
            if time.monotonic() - self._asked_at < CACHE_S:
                return self._problem
            self._problem = self._failing(self._ask())
            self._asked_at = time.monotonic()
            if self._problem != self._reported:
                if self._problem is None:
                    log.info("afd: afd-ctl at %s reports SERVING; healthy", self.controller)
                else:
                    log.warning("afd: unhealthy: %s", self._problem)
                self._reported = self._problem
            return self._problem

    def _ask(self) -> str | None:
        import grpc

        from afd_ctl.v1 import afd_pb2
        from vllm_ext.control import AfdCredentialsRefused

        try:
            status = self._query.get(timeout_s=ASK_TIMEOUT_S)
        except AfdCredentialsRefused as exc:
            return str(exc)
        except grpc.RpcError as exc:
            late = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if late and self._problem is None and self.serving_age_s() < LATE_ANSWER_GRACE_S:
                return None  # the last answer (SERVING) stands; asked again in CACHE_S
            return f"afd-ctl at {self.controller} is unreachable ({exc.code().name})"
        self._epoch = status.epoch
        if status.health == "SERVING":
            self._answered_at = time.monotonic()
            return None
        roles = ", ".join(
            f"{afd_pb2.Role.Name(r.role).lower()} {r.registered}/{r.expected}" for r in status.roles
        )
        return f"afd-ctl at {self.controller} reports {status.health} ({roles} registered)"


def not_serving_error(problem: str) -> Exception:
    """An exception vLLM's /health route turns into 503."""
    from vllm_ext import compat

    class AfdNotServing(compat.seams().engine_dead_error()):  # type: ignore[misc]
        def __str__(self) -> str:
            return f"AFD not serving: {problem}"

    return AfdNotServing()


def wrap_check_health(check_health: Any, monitor: AfdSideMonitor) -> Any:
    """AsyncLLM.check_health, then afd-ctl's view of the set."""

    async def wrapped(self: Any) -> None:
        await check_health(self)
        problem = await asyncio.to_thread(monitor.problem)
        if problem is not None:
            raise not_serving_error(problem)

    return wrapped


def wrap_raise_if_error(raise_if_error: Any, monitor: AfdSideMonitor) -> Any:
    """GenerateBaseServing._raise_if_error: an errored request says what AFD knows."""

    def wrapped(self: Any, finish_reason: str | None, request_id: str) -> None:
        if finish_reason != "error" or not monitor.failed_requests.take(request_id):
            return raise_if_error(self, finish_reason, request_id)
        from vllm_ext import compat

        # Only the cached answer: this runs on the API server's event loop (check_health and
        # its thread keep it fresh).
        problem = monitor.last_problem
        monitor.note_failure()
        if problem is not None:
            detail = f"{problem}. Retry once GET /health returns 200."
        else:
            detail = (
                f"afd-ctl at {monitor.controller} last answered SERVING "
                f"{monitor.serving_age_s():.1f} s before this failure: the loss had not reached "
                "it yet, afd-ctl itself went down since, or only the data plane saw it (the "
                "attention server's log says 'AFD step failed'). Retry once GET /health "
                "returns 200."
            )
        FAILED_REQUESTS.warn(f"{request_id} in the engine ({problem or 'SERVING'})")
        raise compat.seams().request_failed_error(
            f"The request failed: the AFD FFN side could not run its step. {detail}"
        )

    return wrapped


def wrap_streaming_error(convert: Any) -> Any:
    """GenerateBaseServing._convert_generation_error_to_streaming_response: vLLM types every
    streamed GenerationError "InternalServerError"; a failed AFD step (a 503, see
    wrap_raise_if_error) gets the "ServiceUnavailableError" of a plain 503 reply there too, so
    that clients retry a stream the same way."""

    def wrapped(self: Any, e: Any) -> str:
        if getattr(e, "status_code", None) != HTTPStatus.SERVICE_UNAVAILABLE:
            return convert(self, e)
        return self.create_streaming_error_response(
            str(e), err_type="ServiceUnavailableError", status_code=e.status_code
        )

    return wrapped
