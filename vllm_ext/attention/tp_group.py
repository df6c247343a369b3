"""Attention TP > 1: one FFN exchange per TP group.

The TP ranks of an attention server hold the same rows after each attention layer, so only TP
rank 0 (the group's leader) is an AFD attention rank: it registers with afd-ctl, publishes,
and exchanges the rows with the FFN side. The other TP ranks hold no AFD session: each layer
they take the FFN output from the leader through the TP group's all-reduce (they add zeros),
vLLM's own collective, which its CUDA graphs capture as they capture the model's own TP
all-reduces. So the FFN side computes each group's rows once (afd-ctl expects one attention
rank per data-parallel rank) at the cost of one all-reduce of the layer's output per layer,
what a colocated TP MoE layer spends on its own output anyway.

A failed step still ends the attention server under TP > 1 (step_failures.failing_step):
only the leader sees it, and it may raise inside a layer while the others wait in that
layer's all-reduce.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_ext import compat
from vllm_ext.attention.host_time import HostTime
from vllm_ext.attention.verdicts import Verdict, nothing
from vllm_ext.model_split import Exchange

log = logging.getLogger(__name__)


def group_exchange(leader_exchange: Exchange | None) -> Exchange:
    """What the proxies of a TP rank call: the leader's round trip (`leader_exchange`), then
    the group's all-reduce; on the other ranks (None) zeros into the same all-reduce."""
    seams = compat.seams()

    def exchange(
        layer: int, hidden: torch.Tensor, router: torch.Tensor | None, output: torch.Tensor
    ) -> None:
        if leader_exchange is not None:
            leader_exchange(layer, hidden, router, output)
        else:
            output.zero_()
        output.copy_(seams.tensor_parallel_all_reduce(output))

    return exchange


def agreed_full_graphs(leader_full_graphs: bool | None) -> bool:
    """Whether FULL CUDA graphs can hold the leader's exchange (as chosen at connect), on every
    TP rank (each must pick the same CUDA graph mode): the leader's answer on the leader, None
    on the others."""
    mine = 0 if leader_full_graphs is None else 1 + int(leader_full_graphs)
    total = compat.seams().tensor_parallel_sum_on_host(mine)
    if total not in (1, 2):
        raise RuntimeError(
            f"afd: the TP group did not agree on one leader's exchange (sum {total}); vllm_ext bug"
        )
    return total == 2


class FollowerSteps:
    """The step calls a TP rank other than the leader gets from vLLM's runner (the
    vllm_ext.attention.steps.Steps protocol): it checks that each forward runs the rows its
    step was opened for, and nothing else (the leader publishes, exchanges and settles for the
    group)."""

    def __init__(self) -> None:
        self.step_id = 0
        self.flag_counts: dict[str, int] = {}
        self.host_time = HostTime()  # stays empty: the leader's steps cost AFD's host time
        self._rows: list[int] = []

    def open_step(
        self,
        num_tokens: int,
        across_dp: list[int] | None,
        flags: Any,
        stage_tokens: list[int] | None = None,
        full_graph: bool = False,
    ) -> None:
        self.step_id += 1
        self._rows = list(stage_tokens) if stage_tokens else [num_tokens]

    def check_forward(self, num_tokens: int) -> None:
        if num_tokens not in self._rows:
            raise RuntimeError(
                f"afd: step {self.step_id}: a forward of {num_tokens} rows but the step was "
                f"opened for {self._rows}; vllm_ext needs updating for this vLLM"
            )

    def end_step(self) -> None:
        return None

    def finish_forward(self) -> None:
        return None

    def raise_stage_failure(self) -> None:
        return None

    def take_verdict(self) -> Verdict:
        return nothing

    def settle_now(self) -> None:
        return None
