"""Seam: `vllm/model_executor/models/deepseek_v2.py`, the DeepSeek V2/V3 model.

Why: the attention role builds vLLM's own DeepseekV2ForCausalLM with an `AfdFfnProxy` where
each decoder layer holds its MLP/MoE; `DeepseekV2DecoderLayer.__init__` builds those by
module-global name, so the names are swapped while each layer is constructed, and
`DeepseekV2Model.load_weights` is wrapped to skip the FFN tensors, both only inside the load
window. The FFN role builds `DeepseekV2MoE`/`DeepseekV2MLP` and loads them with vLLM's code.
Upstream change that makes it unnecessary: a registered AFD DeepSeek model as Qwen3-MoE has
(vllm_ext/families/qwen3_moe.py), which needs vLLM's DeepseekV2Model to take a decoder layer
type as Qwen3MoeModel does; the FFN-side reaches stay.
Remove when: DeepSeek moves to a registered model (the window goes, the signatures stay).
"""

from __future__ import annotations

from types import ModuleType

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.model_executor.models.deepseek_v2", "DeepseekV2DecoderLayer.__init__", ("self",)),
    (
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2Model.load_weights",
        ("self", "weights"),
    ),
    (
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2MoE.__init__",
        ("config", "parallel_config", "quant_config", "prefix", "apply_routed_scale_to_output"),
    ),
    (
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2MLP.__init__",
        ("hidden_size", "intermediate_size", "hidden_act", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.deepseek_v2", "_get_moe_router_dtype", ()),
    ("vllm.model_executor.models.deepseek_v2", "rocm_aiter_ops.is_fused_moe_enabled", ()),
    (
        "vllm.model_executor.layers.fused_moe.router.gate_linear",
        "GateLinear.__init__",
        ("input_size", "output_size", "out_dtype", "prefix"),
    ),
]


def deepseek_v2_module() -> ModuleType:
    """vllm/model_executor/models/deepseek_v2.py: DeepseekV2DecoderLayer (its constructor
    builds `DeepseekV2MoE`/`DeepseekV2MLP` by module-global name), DeepseekV2Model.load_weights,
    _get_moe_router_dtype, rocm_aiter_ops."""
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2


def gate_linear_class() -> type:
    """The MoE router gate DeepseekV2MoE builds (returns (logits, bias))."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return GateLinear
