"""CUDA graphs on the FFN side, captured and replayed exactly when the payload says so.

The attention side captures its decode graphs keyed by the per-stage token counts and tells
the FFN side what it is doing: `is_graph_capturing` (capture for these counts) and
`is_graph_replaying` (replay the graph captured for these counts). The FFN side keeps one graph
per (stage's counts, layer, stage) over that layer's compute. A step without
`is_graph_replaying` runs eagerly even when its counts equal a captured key: an eager prefill
that happens to match a decode shape must not replay (the reference plugin's bug, fixed there by
this very flag). Communication stays outside the graphs (NIXL is driven from the host); a graph
reads its input from the same receive slot every time and the caller sends its static output on.

A replay step whose (stage's counts, layer, stage) has no graph yet captures it then, on that
step's rows (warm-up, capture, replay: the output is the same as eager), once: the second
micro-batch's stage under dual-batch overlap (the attention side captures one stage, and each
stage reads its own receive slot), or an FFN server that replaced one and never saw the
attention side's capture steps.

Without CUDA (or with enforce_eager) every step runs eagerly and the flags change nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from afd_ctl.step import CAPTURE, EAGER, REPLAY, Counts, Step

log = logging.getLogger(__name__)

# A graph's key: one stage's counts (per attention DP rank), the layer, the stage.
Slot = tuple[tuple[int, ...], int, int]


class FfnGraphMissing(RuntimeError):
    """A payload asked to replay a graph that was never captured for its token counts."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor
    static_router: torch.Tensor | None = None


class FfnGraphRunner:
    """Runs `forward_layer(layer, hidden[, router])` eagerly, capturing, or replaying, per
    payload. `router`: router logits when the gate runs on the attention side (a second graph
    input, like the hidden states)."""

    def __init__(self, forward_layer: Callable[..., torch.Tensor], *, enabled: bool) -> None:
        self.forward_layer = forward_layer
        self.enabled = enabled and torch.cuda.is_available()
        self._graphs: dict[Slot, _Graph] = {}
        self._captured_in_capture_steps: set[tuple[int, ...]] = set()
        self._pool: Any = None
        self._key: Counts = ()
        self._mode = EAGER
        self._step = -1
        # Per layer and stage: graphs captured, replays, eager runs; per step: the mode.
        self.captures = 0
        self.late_captures = 0  # of which on a replay step (see the module's docstring)
        self.replays = 0
        self.eager_runs = 0
        self.steps = {EAGER: 0, CAPTURE: 0, REPLAY: 0}

    @property
    def mode(self) -> str:
        return self._mode

    def begin_step(self, step: Step) -> None:
        self._key = step.graph_key
        self._mode = step.flags.graph_mode(self.enabled)
        self._step = step.step_id
        self.steps[self._mode] += 1

    def stats(self) -> dict[str, int]:
        """What the FFN side did, to compare with the attention side's flags."""
        return {
            # Counts captured in the attention side's capture steps (late captures aside).
            "graph_keys": len(self._captured_in_capture_steps),
            "graph_captures": self.captures,
            "graph_late_captures": self.late_captures,
            "graph_replays": self.replays,
            "graph_capture_steps": self.steps[CAPTURE],
            "graph_replay_steps": self.steps[REPLAY],
            "eager_steps": self.steps[EAGER],
        }

    def run(
        self, layer: int, stage: int, hidden: torch.Tensor, router: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = (hidden,) if router is None else (hidden, router)
        if self._mode == EAGER:
            self.eager_runs += 1
            return self.forward_layer(layer, *inputs)
        slot = (self._key[stage], layer, stage)
        entry = self._graphs.get(slot)
        if self._mode == CAPTURE or entry is None:
            if self._mode == REPLAY:
                self.late_captures += 1
                if layer == 0:
                    log.info(
                        "afd ffn: step %d replays token counts %s in stage %d, never captured "
                        "here: capturing them now, once",
                        self._step,
                        slot[0],
                        stage,
                    )
            else:
                self._captured_in_capture_steps.add(slot[0])
            return self._capture(slot, layer, inputs)
        if entry.static_in.shape != hidden.shape or entry.static_in.dtype != hidden.dtype:
            raise FfnGraphMissing(
                f"payload step {self._step}: layer {layer} stage {stage} input "
                f"{tuple(hidden.shape)} {hidden.dtype} does not match the graph captured for "
                f"{tuple(entry.static_in.shape)} {entry.static_in.dtype}"
            )
        if (router is None) != (entry.static_router is None):
            raise FfnGraphMissing(
                f"payload step {self._step}: layer {layer} stage {stage} was captured "
                f"{'with' if entry.static_router is not None else 'without'} router logits"
            )
        for given, static in ((hidden, entry.static_in), (router, entry.static_router)):
            if given is not None and static is not None and given.data_ptr() != static.data_ptr():
                static.copy_(given)
        entry.graph.replay()
        self.replays += 1
        return entry.static_out

    def _capture(self, slot: Slot, layer: int, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward_layer(layer, *inputs)  # warm-up: lazy inits stay out of the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = self.forward_layer(layer, *inputs)
        self._pool = graph.pool()
        router = inputs[1] if len(inputs) > 1 else None
        self._graphs[slot] = _Graph(graph, inputs[0], static_out, router)
        self.captures += 1
        graph.replay()
        return static_out
