"""FFN side of the GPU-driven exchange: a whole step as one CUDA graph.

On the GPU-driven path every layer of an FFN step is stream work (wait for the attention side's
flag, pull its rows, compute, push each peer its slice, raise its flag: afd_data.gpu_hop), so
the whole step can be captured once per step shape and launched with one call, instead of the
host enqueueing each layer's operations and per-layer graphs (tens of microseconds a layer,
which at 61 layers would pace the step from the host again).

Graphs are keyed by the step's per-stage token counts (as the attention side keys its decode
graphs). The attention side announces each FULL graph it records (`records_only` payloads,
which run nothing on either side), so the FFN side captures the same shapes at start-up; a
shape first seen on a replay or capture step is captured then, before it runs, and replayed
right after. They hold the
addresses of the attention peers' mapped buffers, so every reconnect drops them (`reset`).
A step without a graph flag runs eagerly, layer by layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

Key = tuple[tuple[int, ...], ...]
# A step's (warm_up, enqueue), made on demand (vllm_ext.exchange.gpu).
StepOps = Callable[[], tuple[Callable[[], None], Callable[[], None]]]


class FfnStepGraphs:
    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self.captures = 0
        self.late_captures = 0  # of which on a replay step
        self.replays = 0
        self.resets = 0
        self.keys_in_capture_steps: set[Key] = set()

    def reset(self) -> None:
        """After a reconnect: the graphs hold the previous peers' mapped addresses."""
        if self._graphs:
            self.resets += 1
            log.info("afd ffn: dropping %d step graph(s) at reconnect", len(self._graphs))
        self._graphs.clear()

    def capture(self, key: Key, ops: StepOps, late: bool = False) -> torch.cuda.CUDAGraph:
        """The graph of step shape `key`, captured now if there is none. `ops()` gives the
        step's (warm_up, enqueue), built only for a capture: `warm_up` runs each layer's
        compute once outside the graph (lazy initialisations), `enqueue` issues every layer's
        operations (recorded, not run)."""
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        warm_up, enqueue = ops()
        warm_up()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            enqueue()
        self._pool = graph.pool()
        self._graphs[key] = graph
        self.captures += 1
        if late:  # the first replay of a shape no capture step announced
            self.late_captures += 1
            log.info(
                "afd ffn: token counts %s replayed, never captured here: capturing them now "
                "(one step graph)",
                key,
            )
        else:
            self.keys_in_capture_steps.add(key)
            log.info("afd ffn: captured the step graph for token counts %s", key)
        return graph

    def run(self, key: Key, capture_step: bool, ops: StepOps) -> None:
        """Runs a step of shape `key` from its graph, capturing it first if needed."""
        self.capture(key, ops, late=not capture_step).replay()
        self.replays += 1

    def stats(self) -> dict[str, int]:
        return {
            "step_graph_captures": self.captures,
            "step_graph_late_captures": self.late_captures,
            "step_graph_replays": self.replays,
            "step_graph_resets": self.resets,
        }
