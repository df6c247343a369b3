"""Builds a tiny Qwen3-MoE checkpoint on local disk: config, real-scale weights, tokenizer.

Made as the tiny DeepSeeks are (tiny_deepseek.py: N(0, 0.02) weights so every MLP/MoE block
moves the logits, the same byte-level BPE tokenizer), in the Qwen3-MoE layout vLLM's
Qwen3MoeForCausalLM loads: GQA attention (4 query heads, 2 KV heads) with q/k norms, a softmax
top-k router with `norm_topk_prob`, no shared expert, one expert tensor per expert, and dense
layers from both `decoder_sparse_step` (2: layers 0, 2, 4) and `mlp_only_layers` (3): MoE on
layers 1 and 5.

    python -m vllm_ext.testing.tiny_qwen3_moe OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_ext.testing.tiny_deepseek import (
    BOS_ID,
    EOS_ID,
    INIT_STD,
    VOCAB,
    mlp_shapes,
    write_checkpoint,
)

HIDDEN = 256
LAYERS = 6
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
EXPERTS = 8
TOP_K = 2
DENSE_INTERMEDIATE = 512
MOE_INTERMEDIATE = 128


def config_for() -> dict[str, Any]:
    """The config.json of the tiny model."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, in the Hugging Face Qwen3-MoE checkpoint layout."""
    h = config["hidden_size"]
    d = config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["vocab_size"], h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        a = f"{p}.self_attn"
        shapes[f"{a}.q_proj.weight"] = (config["num_attention_heads"] * d, h)
        shapes[f"{a}.k_proj.weight"] = (config["num_key_value_heads"] * d, h)
        shapes[f"{a}.v_proj.weight"] = (config["num_key_value_heads"] * d, h)
        shapes[f"{a}.o_proj.weight"] = (h, config["num_attention_heads"] * d)
        shapes[f"{a}.q_norm.weight"] = (d,)
        shapes[f"{a}.k_norm.weight"] = (d,)
        m = f"{p}.mlp"
        sparse = (i + 1) % config["decoder_sparse_step"] == 0
        if i in config["mlp_only_layers"] or not sparse:
            mlp_shapes(shapes, m, h, config["intermediate_size"])
            continue
        shapes[f"{m}.gate.weight"] = (config["num_experts"], h)
        for e in range(config["num_experts"]):
            mlp_shapes(shapes, f"{m}.experts.{e}", h, config["moe_intermediate_size"])
    return shapes


def build_tiny_qwen3_moe(out_dir: str | Path, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors and a tokenizer into out_dir; returns out_dir.
    Idempotent: a directory that already holds the same config and seed is left alone."""
    return write_checkpoint(out_dir, config_for(), seed, weight_shapes, "qwen3-moe", "Qwen3-MoE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_qwen3_moe(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
