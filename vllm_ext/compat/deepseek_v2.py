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

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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


def deepseek_v2_module() -> Any:
    """vllm/model_executor/models/deepseek_v2.py: DeepseekV2DecoderLayer (its constructor
    builds `DeepseekV2MoE`/`DeepseekV2MLP` by module-global name), DeepseekV2Model.load_weights,
    _get_moe_router_dtype, rocm_aiter_ops."""
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2


def gate_linear_class() -> Any:
    """The MoE router gate DeepseekV2MoE builds (returns (logits, bias))."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return GateLinear


@contextlib.contextmanager
def layers_built_with(
    moe: Callable[..., Any], mlp: Callable[..., Any], keep_weight: Callable[[str], bool]
) -> Iterator[None]:
    """While vLLM builds a DeepseekV2ForCausalLM inside this window: each
    `DeepseekV2DecoderLayer.__init__` finds `moe` and `mlp` under the module-global names
    `DeepseekV2MoE` and `DeepseekV2MLP` it builds its MLP by (only inside the constructor, so
    the model-level isinstance checks that run afterwards see vLLM's real classes), and
    `DeepseekV2Model.load_weights` loads only the tensors whose name keep_weight accepts.
    Restored in `finally`. tests/test_vllm_compat.py checks the constructor still builds
    its MLP by those names."""
    dsv2 = deepseek_v2_module()
    layer_cls = dsv2.DeepseekV2DecoderLayer
    original_init = layer_cls.__init__
    original_load = dsv2.DeepseekV2Model.load_weights
    moe_cls, mlp_cls = dsv2.DeepseekV2MoE, dsv2.DeepseekV2MLP

    def layer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        dsv2.DeepseekV2MoE, dsv2.DeepseekV2MLP = moe, mlp
        try:
            original_init(self, *args, **kwargs)
        finally:
            dsv2.DeepseekV2MoE, dsv2.DeepseekV2MLP = moe_cls, mlp_cls

    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return original_load(self, ((n, w) for n, w in weights if keep_weight(n)))

    layer_cls.__init__ = layer_init
    dsv2.DeepseekV2Model.load_weights = load_weights
    try:
        yield
    finally:
        layer_cls.__init__ = original_init
        dsv2.DeepseekV2Model.load_weights = original_load
