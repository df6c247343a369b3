"""An attention server that a planned change leaves out (issue 37, `afd-ctl scale`): its API
process drains it and shuts it down, losing no request.

Only a server that follows planned changes (afd max_attention / max_ffn set, data-parallel
size 1: one attention rank, its afd attention_rank) runs this, in its API process:

1. It asks afd-ctl every POLL_S where the membership is going. While a change's target has no
   place for this rank, the server is leaving: `/health` answers 503 saying so (a load balancer
   takes it out), and a new request is refused with a 503 that says to send it elsewhere;
   requests already taken run to their end.
2. Once none is left (the output processor's count), it asks its workers to tell afd-ctl
   `drained` (vLLM's collective_rpc; vllm_ext.attention.worker's afd_drained). afd-ctl then
   fences the attention ranks it keeps, moves to the new epoch and retires this one.
3. When afd-ctl's membership no longer has this rank and no change is in progress, the server
   shuts itself down as `vllm serve` does on SIGTERM, and exits 0.

A change given up or cancelled before its fence lifts the refusal: the server serves on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_ext.attention.health import AfdSideMonitor
    from vllm_ext.config import AfdConfig

log = logging.getLogger(__name__)

POLL_S = 0.5
ASK_TIMEOUT_S = 2.0

IN, LEAVING, OUT = "in", "leaving", "out"


def place_in(status: Any, rank: int) -> tuple[str, str]:
    """Where attention rank `rank` stands in afd-ctl's `status` (an afd.v1.Status): IN (a
    place now or in the target), LEAVING (a place now, none in the target), OUT (no change in
    progress and no place); with the change's label for the messages."""
    current = status.current.attention
    if status.HasField("change"):
        target = status.change.target
        label = f"{target.attention}:{target.ffn}"
        if target.attention <= rank < current:
            return LEAVING, label
        return IN, label
    return (OUT if rank >= current else IN), f"{current}:{status.current.ffn}"


class LeaveWatch:
    """Runs beside the API server of one attention rank; `refusal` is what a request that
    arrives while it is leaving is told (None: serving)."""

    def __init__(self, afd: AfdConfig, monitor: AfdSideMonitor) -> None:
        self.afd = afd
        self.rank = afd.attention_rank
        self.monitor = monitor
        self.refusal: str | None = None
        self._said_drained = False
        self._was_leaving = False

    def start(self, engine: Any) -> None:
        """From AsyncLLM.__init__, on the API server's event loop (an engine built outside a
        running loop, an offline LLM's, has no API to drain: nothing to do)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        engine._afd_leave_watch = loop.create_task(self._run(engine))

    async def _run(self, engine: Any) -> None:
        from vllm_ext.control import ControlAccess, StatusQuery

        query = StatusQuery(ControlAccess.of(self.afd))
        try:
            while True:
                await asyncio.sleep(POLL_S)
                try:
                    status = await asyncio.to_thread(query.get, ASK_TIMEOUT_S)
                except Exception:  # unreachable or refused: /health says so; ask again
                    continue
                if await self._follow(engine, status):
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # never silently: a server that cannot drain must say why
            log.exception("afd attention rank %d: the planned-change watch failed", self.rank)
        finally:
            query.close()

    async def _follow(self, engine: Any, status: Any) -> bool:
        """One look at afd-ctl's answer; True once the server is shutting down."""
        from vllm_ext import compat

        where, label = place_in(status, self.rank)
        if where == IN:
            if self.refusal is not None:
                log.warning("afd attention rank %d: the change was given up; serving on", self.rank)
            self.refusal = self.monitor.leaving = None
            self._said_drained = False
            return False
        if where == OUT:
            if not self._was_leaving:
                return False  # never had a place to leave (afd-ctl itself changed): not ours
            log.info(
                "afd attention rank %d: retired by afd-ctl (the membership is %s); shutting "
                "down as on SIGTERM",
                self.rank,
                label,
            )
            os.kill(os.getpid(), signal.SIGTERM)
            return True
        left = compat.seams().unfinished_requests(engine)
        if self.refusal is None:
            self._was_leaving = True
            log.warning(
                "afd attention rank %d: afd-ctl scale to %s leaves this server out: taking no "
                "new requests, finishing %d",
                self.rank,
                label,
                left,
            )
        self.refusal = (
            f"this attention server is leaving (afd-ctl scale to {label} has no place for "
            f"attention rank {self.rank}); it finishes the requests it has and exits"
        )
        self.monitor.leaving = f"{self.refusal} ({left} request(s) left)"
        if left == 0 and not self._said_drained:
            said = await engine.collective_rpc("afd_drained")
            self._said_drained = any(said or [])
        return False

    def wrap_init(self, init: Any) -> Any:
        watch = self

        def wrapped(engine: Any, *args: Any, **kwargs: Any) -> None:
            init(engine, *args, **kwargs)
            watch.start(engine)

        return wrapped

    def wrap_check_model(self, check_model: Any) -> Any:
        """Every OpenAI request's first check: while leaving, a 503 that says to send the
        request elsewhere (a load balancer's retry does)."""
        watch = self

        async def wrapped(serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            if watch.refusal is not None:
                from http import HTTPStatus

                return serving.create_error_response(
                    f"{watch.refusal}. Send the request to another attention server.",
                    err_type="ServiceUnavailableError",
                    status_code=HTTPStatus.SERVICE_UNAVAILABLE,
                )
            return await check_model(serving, request, *args, **kwargs)

        return wrapped
