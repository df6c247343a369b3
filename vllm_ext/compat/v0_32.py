"""vLLM 0.32's internals as vllm_ext reaches them (the main CPU line; 0.33 is close but not
supported). What is the same on 0.26 comes from `_shared`."""

from __future__ import annotations

from typing import Any

from vllm_ext.compat._shared import *  # noqa: F403
from vllm_ext.compat._shared import SIGNATURES as _SHARED_SIGNATURES

LINE = "0.32"

SIGNATURES = [
    *_SHARED_SIGNATURES,
    ("vllm.exceptions", "RetryableRequestError", ()),
    ("vllm.model_executor.layers.fused_moe.utils", "is_model_fused_shared_expert_compatible", ()),
    (
        "vllm.model_executor.models.qwen3_moe",
        "GateLinear.__init__",
        ("input_size", "output_size", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.qwen3_moe", "ParallelLMHead.tie_weights", ("self",)),
]


def fused_shared_expert_compatible(layers: Any, moe_cls: type) -> bool:
    """What DeepseekV2Model sets as is_fused_shared_expert_enabled; its load_weights reads it."""
    from vllm.model_executor.layers.fused_moe.utils import (
        is_model_fused_shared_expert_compatible,
    )

    return bool(is_model_fused_shared_expert_compatible(layers, moe_cls, "mlp"))


def request_failed_error(message: str) -> Exception:
    """An error vLLM's OpenAI server answers with 503 (vllm/exceptions.py): a request that
    failed for a reason a retry can fix."""
    from vllm.exceptions import RetryableRequestError

    return RetryableRequestError(message)


def qwen3_moe_gate(config: Any, quant_config: Any, prefix: str) -> Any:
    """The router gate Qwen3MoeSparseMoeBlock builds on 0.32: a GateLinear."""
    from vllm.model_executor.models.qwen3_moe import GateLinear

    return GateLinear(
        config.hidden_size, config.num_experts, quant_config=quant_config, prefix=prefix
    )


def tie_lm_head(lm_head: Any, embed_tokens: Any) -> Any:
    """What Qwen3MoeForCausalLM does with tie_word_embeddings on 0.32."""
    return lm_head.tie_weights(embed_tokens)


def loaded_parameter_names(loaded: set[str]) -> set[str]:
    """The parameter names a model-level load_weights loaded: as reported on 0.32."""
    return loaded


def localize_cpu_routing(model: Any, *, masks: bool = False) -> int:
    """0.32's CPU MoE experts (experts/cpu_moe.py) are a modular kernel's `fused_experts`,
    whose `apply(..., topk_weights=, topk_ids=, expert_map=, ...)` ignores the map; that call
    gets local ids."""
    from vllm_ext.compat import expert_parallel

    def wrap(layer: Any, expert_map: Any) -> None:
        experts = layer.quant_method.moe_kernel.fused_experts
        apply = experts.apply
        if getattr(apply, "afd_local_routing", False):
            return

        def local_apply(*args: Any, topk_weights: Any, topk_ids: Any, **kwargs: Any) -> Any:
            weights, ids = expert_parallel.local_routing(topk_weights, topk_ids, expert_map)
            return apply(*args, topk_weights=weights, topk_ids=ids, **kwargs)

        local_apply.afd_local_routing = True  # type: ignore[attr-defined]
        experts.apply = local_apply

    return expert_parallel.wrap_cpu_kernels(model, wrap, masks=masks)
