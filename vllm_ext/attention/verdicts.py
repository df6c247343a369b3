"""The verdicts of closed steps, asked where vLLM first reads what they produced.

A GPU-driven step is only enqueued when the attention worker closes it: whether it ran to its
end or was released with poison (a peer lost, or past its bound) is known later, beside the
host (vllm_ext.exchange.gpu_watchdog). vLLM reads a step's sampled tokens once, after its own
sync on them: at once when sample_tokens returns a synchronous output, inside get_output() for
an asynchronous one (async scheduling). `take` hands vLLM the check of every step closed since
the last call, to run there: it raises AfdStepFailed for a failed step, so none of its tokens
reaches the scheduler (nor any client).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from vllm_ext.exchange.base import AttentionExchange

Verdict = Callable[[], None]
Failing = Callable[[int], contextlib.AbstractContextManager[None]]


def nothing() -> None:
    return None


class Verdicts:
    def __init__(self, failing: Failing) -> None:
        """`failing(step_id)`: the context that turns AFD errors of a step into AfdStepFailed."""
        self._failing = failing
        # Closed steps whose verdict nobody asked for yet, each with the exchange it ran on.
        self._closed: list[tuple[AttentionExchange, int]] = []

    def closed(self, exchange: AttentionExchange, step_id: int) -> None:
        self._closed.append((exchange, step_id))

    def clear(self) -> None:
        """A step failed: the engine fails every running request, so the verdicts of the steps
        before it are moot (asking them later would fail a good step)."""
        self._closed.clear()

    def take(self) -> Verdict:
        """The check of the steps closed since the last call."""
        closed, self._closed = self._closed, []
        if not closed:
            return nothing
        by_exchange: dict[int, tuple[AttentionExchange, list[int]]] = {}
        for exchange, step_id in closed:  # more than one only across a change of path
            by_exchange.setdefault(id(exchange), (exchange, []))[1].append(step_id)

        def verdict() -> None:
            with self._failing(closed[-1][1]):
                for exchange, ids in by_exchange.values():
                    exchange.settle(ids)

        return verdict
