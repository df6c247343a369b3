"""DeepSeek-V2/V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): the split.

Attention role: vLLM builds its own DeepseekV2ForCausalLM, but while each decoder layer is
constructed the names `DeepseekV2MoE` and `DeepseekV2MLP` in vLLM's model module resolve to
`AfdFfnProxy` (the load window below; the swap is compat's `layers_built_with`, restored in
`finally`); the checkpoint's `.mlp.` tensors are skipped at load. MLA attention, layernorms,
embeddings and lm_head stay as vLLM built them.
(Not yet a registered model as Qwen3-MoE is: the window predates the family modules.)

FFN role: `layers[i].mlp` built with vLLM's own DeepseekV2MoE/DeepseekV2MLP and loaded with
DeepseekV2Model.load_weights from the `.mlp.` tensors. Dense layers: `first_k_dense_replace`,
`moe_layer_freq`; shared experts whole, on FFN shard 0 only (vllm_ext.ffn.stack).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm_ext import compat
from vllm_ext.families import Family
from vllm_ext.model_split import AfdFfnProxy


def _layer_idx(prefix: str) -> int:
    match = re.search(r"layers\.(\d+)\.mlp$", prefix)
    if match is None:
        raise ValueError(f"afd: cannot tell the layer of MLP prefix {prefix!r}")
    return int(match.group(1))


class _Overlay:
    """A model config with some attributes replaced (HF configs validate their fields, and
    n_shared_experts may not be None there)."""

    def __init__(self, config: Any, **replaced: Any) -> None:
        self._config, self._replaced = config, replaced

    def __getattr__(self, name: str) -> Any:
        replaced = self.__dict__["_replaced"]
        return replaced[name] if name in replaced else getattr(self.__dict__["_config"], name)


class DeepSeek(Family):
    name = "deepseek"
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

    def attention_gate(self, config: Any, prefix: str) -> nn.Module:
        """The MoE layer's router gate, built as DeepseekV2MoE builds it."""
        seams = compat.seams()
        return seams.gate_linear_class()(
            config.hidden_size,
            config.n_routed_experts,
            out_dtype=seams.deepseek_v2_module()._get_moe_router_dtype(config),
            prefix=f"{prefix}.gate",
        )

    def attention_load_window(self, gate_here: bool) -> contextlib.AbstractContextManager[None]:
        """vLLM's own model, each decoder layer built with proxies where its MLP/MoE would be
        and the FFN tensors skipped at load (the swap itself: compat.layers_built_with)."""
        family = self

        def proxy_moe(*, prefix: str = "", config: Any = None, **_: Any) -> AfdFfnProxy:
            gate = family.attention_gate(config, prefix) if gate_here else None
            return AfdFfnProxy(_layer_idx(prefix), "moe", gate)

        def proxy_mlp(*, prefix: str = "", **_: Any) -> AfdFfnProxy:
            return AfdFfnProxy(_layer_idx(prefix), "mlp")

        def keep(name: str) -> bool:
            return not family.is_ffn_weight(name) or (gate_here and family.is_gate_weight(name))

        return compat.seams().layers_built_with(proxy_moe, proxy_mlp, keep)

    def num_routed_experts(self, config: Any) -> int | None:
        return getattr(config, "n_routed_experts", None)

    def router_dtype(self, config: Any, model_dtype: torch.dtype) -> torch.dtype:
        """vLLM's gate computes in the model's dtype unless the config asks for float32."""
        dtype = compat.seams().deepseek_v2_module()._get_moe_router_dtype(config)
        return dtype or model_dtype

    def is_moe_layer(self, config: Any, layer_idx: int) -> bool:
        return (
            config.n_routed_experts is not None
            and layer_idx >= config.first_k_dense_replace
            and layer_idx % getattr(config, "moe_layer_freq", 1) == 0
        )

    def build_ffn_layer(
        self, vllm_config: Any, layer_idx: int, prefix: str, shared: bool = True
    ) -> tuple[nn.Module, bool]:
        dsv2 = compat.seams().deepseek_v2_module()
        config = vllm_config.model_config.hf_config
        if self.is_moe_layer(config, layer_idx):
            if not shared and config.n_shared_experts is not None:
                config = _Overlay(config, n_shared_experts=None)  # then DeepseekV2MoE has none
            return dsv2.DeepseekV2MoE(
                config=config,
                parallel_config=vllm_config.parallel_config,
                quant_config=vllm_config.quant_config,
                prefix=prefix,
                apply_routed_scale_to_output=not dsv2.rocm_aiter_ops.is_fused_moe_enabled(),
            ), True
        return dsv2.DeepseekV2MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        ), False

    def prepare_ffn_stack(self, stack: Any, vllm_config: Any) -> None:
        """What DeepseekV2Model.load_weights reads from the model it runs on."""
        seams = compat.seams()
        stack.use_mha = False
        stack.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        stack.is_fused_shared_expert_enabled = seams.fused_shared_expert_compatible(
            stack.layers, seams.deepseek_v2_module().DeepseekV2MoE
        )

    def load_ffn_weights(
        self, stack: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> set[str]:
        dsv2 = compat.seams().deepseek_v2_module()
        return dsv2.DeepseekV2Model.load_weights(stack, weights)

    def dense_output(self, config: Any, out: torch.Tensor) -> torch.Tensor:
        """What DeepseekV2DecoderLayer.forward does after a dense MLP in fp16."""
        if out.dtype == torch.float16:
            return out * (1.0 / getattr(config, "routed_scaling_factor", 1.0))
        return out


FAMILY = DeepSeek()
