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
