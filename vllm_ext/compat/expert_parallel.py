"""Seam: expert parallelism on one FFN rank (`vllm/model_executor/layers/fused_moe/layer.py`
`make_parallel_config` and `FusedMoEParallelConfig`; `routed_experts.py` `RoutedExperts`; the
CPU MoE kernels: 0.32 `experts/cpu_moe.py` `CPUUnquantizedExperts.apply`, 0.26
`cpu_fused_moe.py` `CPUFusedMOE.forward_method`).

Why: an FFN rank runs in a world of one (there is no vLLM expert-parallel group across FFN
servers: the combine is the attention side's sum of their partial outputs), yet it should hold
and compute only its slice of the routed experts. vLLM's EP placement does exactly that
(ExpertMapManager: the local experts, the expert map, a weight loader that skips other ranks'
experts) once a MoE layer's parallel config says ep_size=N, ep_rank=r. That config is derived
from the process's parallel groups, so while the FFN stack is built `make_parallel_config`
answers with it (tp 1 and dp 1: no all-to-all kernels; the layer's closing all-reduce runs on
the one-rank TP group, where it returns its input). vLLM's CPU MoE kernels ignore the expert
map (they index the weights with global expert ids), so on CPU each layer's kernel gets the
routing in local ids, other ranks' top-k slots weighted 0: the same partial sum.
Upstream change that makes it unnecessary: a MoE layer that takes its EP rank and size, and CPU
kernels that honour the expert map.
Remove when: both are in the supported lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from vllm_ext.compat.worker import on_cpu

_LAYER = "vllm.model_executor.layers.fused_moe.layer"
_ROUTED = "vllm.model_executor.layers.fused_moe.routed_experts"

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    (
        _LAYER,
        "make_parallel_config",
        ("tp_size", "dp_size", "pcp_size", "is_sequence_parallel", "parallel_config"),
    ),
    ("vllm.model_executor.layers.fused_moe.config", "FusedMoEParallelConfig", ()),
    (_ROUTED, "RoutedExperts.expert_map", ()),
    (
        "vllm.model_executor.layers.fused_moe.expert_map_manager",
        "determine_expert_map",
        ("ep_size", "ep_rank", "global_num_experts"),
    ),
]


@contextlib.contextmanager
def expert_parallel_window(index: int, count: int) -> Iterator[None]:
    """MoE layers built inside are expert-parallel rank `index` of `count` (no-op for 1)."""
    if count == 1:
        yield
        return
    import vllm.model_executor.layers.fused_moe.layer as layer

    original = layer.make_parallel_config

    def ep_config(*args: Any, **kwargs: Any) -> Any:
        base = original(*args, **kwargs)
        if base.tp_size != 1 or base.dp_size != 1 or base.pcp_size != 1:
            raise ValueError(
                "afd ffn: an FFN server runs in a world of one (tensor-, data- and "
                "context-parallel size 1); its expert parallelism comes from afd-ctl's groups"
            )
        return dataclasses.replace(base, use_ep=True, ep_size=count, ep_rank=index)

    layer.make_parallel_config = ep_config
    try:
        yield
    finally:
        layer.make_parallel_config = original


def routed_experts_modules(model: Any) -> list[Any]:
    """vLLM's RoutedExperts modules (the routed experts' weights and expert map) in `model`."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def local_expert_count(model: Any) -> int:
    """Routed experts a MoE layer of `model` holds (the first such layer's)."""
    found = routed_experts_modules(model)
    return int(found[0].local_num_experts) if found else 0


def _local_ids(topk_ids: Any, expert_map: Any) -> tuple[Any, Any]:
    """(each top-k slot's local expert id, -1 where another rank holds it; that mask)."""
    local = expert_map[topk_ids.long()]
    return local, local < 0


def local_routing(topk_weights: Any, topk_ids: Any, expert_map: Any) -> tuple[Any, Any]:
    """Top-k routing in local expert ids: other ranks' slots point at local expert 0 with
    weight 0, so a kernel that reads every slot adds exactly this rank's partial sum."""
    local, elsewhere = _local_ids(topk_ids, expert_map)
    return topk_weights.masked_fill(elsewhere, 0), local.clamp(min=0).to(topk_ids.dtype)


def null_slot_routing(
    topk_weights: Any, topk_ids: Any, expert_map: Any, local_count: int
) -> tuple[Any, Any]:
    """As local_routing, for a kernel that needs each token's ids distinct: top-k slot j held
    elsewhere points at null expert `local_count + j` (one that computes zeros), weight 0."""
    import torch

    local, elsewhere = _local_ids(topk_ids, expert_map)
    slots = torch.arange(topk_ids.shape[1], device=topk_ids.device) + local_count
    ids = torch.where(elsewhere, slots.to(local.dtype).expand_as(local), local)
    return topk_weights.masked_fill(elsewhere, 0), ids.to(topk_ids.dtype)


def wrap_cpu_kernels(
    model: Any, wrap_kernel: Callable[[Any, Any], None], *, masks: bool = False
) -> int:
    """On CPU, gives every expert-parallel MoE layer's kernel its routing in local ids
    (`wrap_kernel(layer, expert_map)`, per vLLM line); returns the layers changed. With
    `masks`, a layer that holds every routed expert gets a map of its own too (identity, kept
    as `afd_expert_mask`), which `narrow_experts` later narrows in place."""
    if not on_cpu():
        return 0
    import torch

    changed = 0
    for layer in routed_experts_modules(model):
        expert_map = layer.expert_map
        if expert_map is None and masks:
            expert_map = getattr(layer, "afd_expert_mask", None)
            if expert_map is None:
                count = int(layer.global_num_experts)
                expert_map = torch.arange(count, dtype=torch.int32)
                layer.afd_expert_mask = expert_map
        if expert_map is not None:
            wrap_kernel(layer, expert_map)
            changed += 1
    return changed


def narrow_experts(model: Any, index: int, count: int) -> int:
    """Issue 37: an FFN rank that loaded every routed expert computes, from its next step,
    only vLLM's expert-parallel shard `index` of `count` (linear placement, as the ranks that
    loaded only their shard hold it); count 1 computes every expert again. Needs the masks of
    `wrap_cpu_kernels(..., masks=True)` (CPU); returns the layers narrowed."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    narrowed = 0
    for layer in routed_experts_modules(model):
        mask = getattr(layer, "afd_expert_mask", None)
        if mask is None:
            continue
        total = mask.shape[0]
        ids = torch.arange(total, dtype=mask.dtype)
        if count > 1:
            _, shard_map, _ = determine_expert_map(
                ep_size=count, ep_rank=index, global_num_experts=total
            )
            assert shard_map is not None
            ids = torch.where(shard_map >= 0, ids, torch.full_like(ids, -1))
        mask.copy_(ids)
        narrowed += 1
    return narrowed
