"""A step that was published but whose forward did not run every layer (it raised).

The FFN side waits for the rest of that step, so the attention side sends zeros for the
remaining layers of every stage, in the order the FFN side takes them (layer by layer, stage 0
first), and drops the outputs; the next step then starts on a clean exchange.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from afd_ctl.step import Step
from vllm_ext.attention.step_failures import AfdStepFailed, failing_step
from vllm_ext.exchange.base import AttentionExchange

if TYPE_CHECKING:
    from vllm_ext.attention.steps import RankShape

log = logging.getLogger(__name__)


def complete_abandoned(
    step: Step,
    exchange: AttentionExchange,
    stage_rows: list[int],
    layers_done: list[int],
    rank: RankShape,
) -> None:
    """Completes `step` with zeros: each stage's `layers_done` layers ran, of rank.num_layers."""
    log.warning(
        "afd attention %s: step %d ended after %s of %d layers per stage; completing it with zeros",
        rank.worker_id,
        step.step_id,
        layers_done,
        rank.num_layers,
    )
    if step.flags.records_only:
        return  # recorded, never run: nothing waits for it
    zeros = [
        torch.zeros(rows, rank.hidden_size, dtype=rank.dtype, device=exchange.device)
        for rows in stage_rows
    ]
    try:
        with failing_step(step.step_id):
            for layer in range(min(layers_done), rank.num_layers):
                todo = [s for s, done in enumerate(layers_done) if done <= layer]
                for stage in todo:
                    exchange.post(layer, stage, zeros[stage], None)
                for stage in todo:
                    exchange.take(layer, stage, torch.empty_like(zeros[stage]))
            exchange.end_step()
    except AfdStepFailed as exc:  # the next step reconnects if the FFN side is gone
        log.warning("afd attention %s: %s", rank.worker_id, exc)
