"""vLLM 0.26's internals as vllm_ext reaches them (the line that runs on the H200 machines:
it pins their torch 2.11). What is the same on 0.32 comes from `_shared`.

Differences from 0.32 that matter here:
- no RetryableRequestError: a GenerationError carries its HTTP status instead;
- the GPU worker builds its runner inside init_device (no _make_model_runner); `compat.worker`'s
  runner_class_swapped covers both;
- DeepseekV2Model.load_weights reads no is_fused_shared_expert_enabled;
- the CPU platform has no MLA backend: DeepSeek runs there with VLLM_MLA_DISABLE=1.
"""

from __future__ import annotations

from typing import Any

from vllm_ext.compat._shared import *  # noqa: F403
from vllm_ext.compat._shared import SIGNATURES as _SHARED_SIGNATURES

LINE = "0.26"

SIGNATURES = [
    *_SHARED_SIGNATURES,
    ("vllm.entrypoints.openai.engine.protocol", "GenerationError.__init__", ("message",)),
    (
        "vllm.model_executor.models.qwen3_moe",
        "ReplicatedLinear.__init__",
        ("input_size", "output_size", "bias", "quant_config", "prefix"),
    ),
]


def fused_shared_expert_compatible(layers: Any, moe_cls: type) -> bool:
    """0.26's DeepseekV2Model.load_weights does not read is_fused_shared_expert_enabled (it
    asks rocm_aiter_ops instead): nothing to set."""
    return False


def request_failed_error(message: str) -> Exception:
    """An error vLLM's OpenAI server answers with 503: GenerationError takes its status from
    `status_code` (vllm/entrypoints/serve/utils/error_response.py)."""
    from http import HTTPStatus

    from vllm.entrypoints.openai.engine.protocol import GenerationError

    error = GenerationError(message)
    error.status_code = HTTPStatus.SERVICE_UNAVAILABLE
    return error


def qwen3_moe_gate(config: Any, quant_config: Any, prefix: str) -> Any:
    """The router gate Qwen3MoeSparseMoeBlock builds on 0.26: a ReplicatedLinear."""
    from vllm.model_executor.models.qwen3_moe import ReplicatedLinear

    return ReplicatedLinear(
        config.hidden_size, config.num_experts, bias=False, quant_config=quant_config, prefix=prefix
    )


def tie_lm_head(lm_head: Any, embed_tokens: Any) -> Any:
    """What Qwen3MoeForCausalLM does with tie_word_embeddings on 0.26."""
    lm_head.weight = embed_tokens.weight
    return lm_head


def loaded_parameter_names(loaded: set[str]) -> set[str]:
    """The parameter names a model-level load_weights loaded. 0.26's MoERunner.load_weights
    (vllm/model_executor/layers/fused_moe/runner/moe_runner.py) reports its experts' tensors
    without the `routed_experts.` that is in their parameter names (vLLM's own loader counts
    them as loaded through their quant method instead): both spellings count."""
    return loaded | {
        n.replace(".experts.", ".experts.routed_experts.", 1) for n in loaded if ".experts." in n
    }


def localize_cpu_routing(model: Any, *, masks: bool = False) -> int:
    """0.26's CPU MoE path (cpu_fused_moe.CPUFusedMOE) routes, then calls its
    `forward_method(layer, x, topk_weights, topk_ids, global_num_experts, ...)`; that call gets
    local ids. Its torch fallback (`forward_torch`, what float32 runs) counts a token once per
    distinct expert id, so there other ranks' slots go to zero-output null experts appended to
    the layer's per-expert lists, one per top-k slot."""
    from vllm_ext.compat import expert_parallel

    def wrap(layer: Any, expert_map: Any) -> None:
        kernel = layer.quant_method.cpu_fused_moe
        forward = getattr(kernel, "forward_method", None)
        if forward is None:
            raise ValueError(
                "afd ffn: vLLM's SGL CPU MoE kernel (VLLM_CPU_SGL_KERNEL=1) cannot run an "
                "expert-parallel FFN rank; unset VLLM_CPU_SGL_KERNEL"
            )
        if getattr(forward, "afd_local_routing", False):
            return
        local_count = int(layer.local_num_experts)
        null_slots = forward == kernel.forward_torch
        if null_slots:
            for _ in range(layer.top_k):
                layer.gate_up_linear.append(lambda x: x.new_zeros(x.shape[0], 2))
                layer.down_linear.append(lambda x, h=layer.hidden_size: x.new_zeros(x.shape[0], h))

        def local_forward(
            layer_: Any, x: Any, weights: Any, ids: Any, activation: Any, n: int, *rest: Any
        ) -> Any:
            if null_slots:
                weights, ids = expert_parallel.null_slot_routing(
                    weights, ids, expert_map, local_count
                )
                n = local_count + ids.shape[1]
            else:
                weights, ids = expert_parallel.local_routing(weights, ids, expert_map)
            return forward(layer_, x, weights, ids, activation, n, *rest)

        local_forward.afd_local_routing = True  # type: ignore[attr-defined]
        kernel.forward_method = local_forward

    return expert_parallel.wrap_cpu_kernels(model, wrap, masks=masks)
