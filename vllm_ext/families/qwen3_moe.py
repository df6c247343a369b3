"""Qwen3-MoE (`Qwen3MoeForCausalLM`): the split.

Attention role: `AfdQwen3MoeForCausalLM`, registered with vLLM's ModelRegistry as
`AfdQwen3MoeForCausalLM` (the attention role's config names it; families.use_attention_model).
It is vLLM's Qwen3MoeForCausalLM with vLLM's own Qwen3MoeModel, built with
`decoder_layer_type=AfdQwen3MoeDecoderLayer`: vLLM's decoder layer (its forward unchanged) whose
constructor builds vLLM's GQA attention with q/k norms and the two RMSNorms, and an
`AfdFfnProxy` where `mlp` was (holding vLLM's router gate when the gate runs on the attention
side). The checkpoint's `.mlp.` tensors are skipped at load, but the gate's then.

FFN role: `layers[i].mlp` built with vLLM's own Qwen3MoeSparseMoeBlock (softmax top-k router,
`norm_topk_prob`, no shared expert) or Qwen3MoeMLP for the dense layers (`mlp_only_layers`,
`decoder_sparse_step`), loaded with Qwen3MoeModel.load_weights from the `.mlp.` tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm_ext import compat
from vllm_ext.config import from_vllm_config
from vllm_ext.families import Family
from vllm_ext.model_split import AfdFfnProxy


def _qwen3() -> Any:
    return compat.seams().model_module("qwen3_moe")


def _is_moe_layer(config: Any, layer_idx: int) -> bool:
    """As Qwen3MoeDecoderLayer decides it."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    attention_architecture = "AfdQwen3MoeForCausalLM"
    attention_model = "vllm_ext.families.qwen3_moe:AfdQwen3MoeForCausalLM"

    def num_routed_experts(self, config: Any) -> int | None:
        return getattr(config, "num_experts", None) or None

    def router_dtype(self, config: Any, model_dtype: torch.dtype) -> torch.dtype:
        """Qwen3MoeSparseMoeBlock's gate is a plain linear layer in the model's dtype."""
        return model_dtype

    def is_moe_layer(self, config: Any, layer_idx: int) -> bool:
        return _is_moe_layer(config, layer_idx)

    def build_ffn_layer(
        self, vllm_config: Any, layer_idx: int, prefix: str, shared: bool = True
    ) -> tuple[nn.Module, bool]:
        qwen3 = _qwen3()
        config = vllm_config.model_config.hf_text_config
        if _is_moe_layer(config, layer_idx):
            if not shared and getattr(config, "shared_expert_intermediate_size", None):
                raise ValueError(
                    "afd ffn: expert-parallel FFN ranks of a Qwen-MoE with a shared expert are "
                    "not supported yet; serve it with one FFN rank per group"
                )
            return qwen3.Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=prefix), True
        return qwen3.Qwen3MoeMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        ), False

    def prepare_ffn_stack(self, stack: nn.Module, vllm_config: Any) -> None:
        """Qwen3MoeModel.load_weights maps names with the model's hf_to_vllm_mapper."""
        stack.hf_to_vllm_mapper = _qwen3().Qwen3MoeModel.hf_to_vllm_mapper

    def load_ffn_weights(
        self, stack: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> set[str]:
        return _qwen3().Qwen3MoeModel.load_weights(stack, weights)


FAMILY = Qwen3Moe()


# -- the attention role's model (built by vLLM in the engine core or a worker) ---------------
@functools.cache
def _decoder_layer_class() -> type:
    qwen3 = _qwen3()

    class AfdQwen3MoeDecoderLayer(qwen3.Qwen3MoeDecoderLayer):  # type: ignore[name-defined]
        """vLLM's Qwen3MoeDecoderLayer (forward unchanged) with the MLP/MoE on the FFN side."""

        def __init__(self, vllm_config: Any, prefix: str = "", gate_here: bool = False) -> None:
            nn.Module.__init__(self)
            config = vllm_config.model_config.hf_text_config
            self.hidden_size = config.hidden_size
            self.self_attn = qwen3.Qwen3MoeAttention(
                hidden_size=self.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                rope_parameters=config.rope_parameters,
                max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
                rms_norm_eps=config.rms_norm_eps,
                qkv_bias=getattr(config, "attention_bias", False),
                head_dim=getattr(config, "head_dim", None),
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.self_attn",
                dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None),
            )
            layer_idx = int(prefix.rsplit(".", 1)[-1])
            is_moe = _is_moe_layer(config, layer_idx)
            gate = None
            if is_moe and gate_here:
                gate = compat.seams().qwen3_moe_gate(
                    config, vllm_config.quant_config, f"{prefix}.mlp.gate"
                )
            self.mlp = AfdFfnProxy(layer_idx, "moe" if is_moe else "mlp", gate)
            self.input_layernorm = qwen3.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = qwen3.RMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )

    return AfdQwen3MoeDecoderLayer


@functools.cache
def _model_class() -> type:
    qwen3 = _qwen3()

    class AfdQwen3MoeForCausalLM(qwen3.Qwen3MoeForCausalLM):  # type: ignore[name-defined]
        """vLLM's Qwen3MoeForCausalLM, its decoder layers holding no MLP/MoE (no experts: the
        MoE bookkeeping of the class is empty)."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            nn.Module.__init__(self)
            config = vllm_config.model_config.hf_text_config
            afd = from_vllm_config(vllm_config)
            self.gate_here = afd is not None and afd.gate == "attention"
            self.config = config
            self.quant_config = vllm_config.quant_config
            self.model = qwen3.Qwen3MoeModel(
                vllm_config=vllm_config,
                prefix=qwen3.maybe_prefix(prefix, "model"),
                decoder_layer_type=functools.partial(
                    _decoder_layer_class(), gate_here=self.gate_here
                ),
            )
            self.lm_head = qwen3.ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=self.quant_config,
                prefix=qwen3.maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = compat.seams().tie_lm_head(self.lm_head, self.model.embed_tokens)
            self.logits_processor = qwen3.LogitsProcessor(config.vocab_size)
            self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
            self.moe_layers: list[nn.Module] = []
            self.num_moe_layers = 0
            self.num_expert_groups = 1
            self.num_shared_experts = 0
            self.num_logical_experts = self.num_physical_experts = 0
            self.num_local_physical_experts = self.num_routed_experts = 0
            self.num_redundant_experts = 0

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            kept = (
                (n, w)
                for n, w in weights
                if not FAMILY.is_ffn_weight(n) or (self.gate_here and FAMILY.is_gate_weight(n))
            )
            return super().load_weights(kept)

    return AfdQwen3MoeForCausalLM


def __getattr__(name: str) -> Any:
    """vLLM's loader imports `AfdQwen3MoeForCausalLM` from here ("module:Class"); the class is
    made on first use, so importing this module imports nothing of vLLM's models."""
    if name == "AfdQwen3MoeForCausalLM":
        cls = _model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
