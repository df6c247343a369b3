"""Builds a tiny DeepSeek-V2 or -V3 checkpoint on local disk: config, real-scale weights, tokenizer.

Why not `load_format="dummy"`: vLLM's dummy weights are so small that every layer contributes
almost nothing, so a broken attention->FFN hand-off goes unnoticed. These weights are N(0, 0.02)
like a freshly initialised model, so every MLP/MoE block moves the logits.

The shapes follow the CPU MLA kernel's one supported head size (kv_lora_rank + qk_rope_head_dim
= 512 + 64). Tensor names follow the original DeepSeek checkpoints (one tensor per expert), which
is what vLLM's DeepseekV2ForCausalLM.load_weights expects.

    python -m vllm_ext.testing.tiny_deepseek OUT_DIR [--version 2|3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HIDDEN = 256
LAYERS = 4
HEADS = 4
VOCAB = 512
ROUTED_EXPERTS = 8
TOP_K = 2
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 64
# On GPU vLLM's MLA prefill (FlashAttention) takes DeepSeek's own head sizes only: nope and v 128.
GPU_HEAD_DIM = 128
DENSE_INTERMEDIATE = 512
MOE_INTERMEDIATE = 128
Q_LORA_RANK_V3 = 128
INIT_STD = 0.02
BOS_ID, EOS_ID = 0, 1

# A few hundred words of plain English for the byte-level BPE merges; deterministic.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A model of experts routes every token to a few
of its experts and adds a shared expert that every token visits. Attention keeps the cache of
keys and values; the feed forward half holds most of the weights. Hello, my name is Ada and I
write programs for machines that think in numbers. The capital of France is Paris, the capital
of Italy is Rome and the capital of Japan is Tokyo. Once upon a time there was a small robot who
wanted to learn how to paint the sea, the sky and the mountains at dawn. What is the answer to
life, the universe and everything? Numbers: one two three four five six seven eight nine ten.
The future of artificial intelligence depends on data, compute and careful engineering. We
send hidden states from attention workers to feed forward workers and back again, every layer,
every step, and the tokens that come out must be the same as before.
"""


def config_for(version: int, head_dim: int = QK_NOPE_HEAD_DIM) -> dict[str, Any]:
    """The config.json of the tiny model (DeepSeek-V2-Lite style for 2, V3 style for 3)."""
    if version not in (2, 3):
        raise ValueError(f"version must be 2 or 3, got {version}")
    config: dict[str, Any] = {
        "architectures": [f"DeepseekV{version}ForCausalLM"],
        "model_type": f"deepseek_v{version}",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "n_shared_experts": 1,
        "n_routed_experts": ROUTED_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": KV_LORA_RANK,
        "q_lora_rank": None,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
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
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
    }
    if version == 2:
        config.update(
            topk_method="greedy",
            scoring_func="softmax",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        )
    else:
        config.update(
            q_lora_rank=Q_LORA_RANK_V3,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
    return config


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, in the original DeepSeek checkpoint layout."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
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
        if config["q_lora_rank"]:
            shapes[f"{a}.q_a_proj.weight"] = (config["q_lora_rank"], h)
            shapes[f"{a}.q_a_layernorm.weight"] = (config["q_lora_rank"],)
            shapes[f"{a}.q_b_proj.weight"] = (heads * qk_head, config["q_lora_rank"])
        else:
            shapes[f"{a}.q_proj.weight"] = (heads * qk_head, h)
        shapes[f"{a}.kv_a_proj_with_mqa.weight"] = (
            config["kv_lora_rank"] + config["qk_rope_head_dim"],
            h,
        )
        shapes[f"{a}.kv_a_layernorm.weight"] = (config["kv_lora_rank"],)
        shapes[f"{a}.kv_b_proj.weight"] = (
            heads * (config["qk_nope_head_dim"] + config["v_head_dim"]),
            config["kv_lora_rank"],
        )
        shapes[f"{a}.o_proj.weight"] = (h, heads * config["v_head_dim"])
        m = f"{p}.mlp"
        if i < config["first_k_dense_replace"]:
            mlp_shapes(shapes, m, h, config["intermediate_size"])
            continue
        shapes[f"{m}.gate.weight"] = (config["n_routed_experts"], h)
        if config["topk_method"] == "noaux_tc":
            shapes[f"{m}.gate.e_score_correction_bias"] = (config["n_routed_experts"],)
        for e in range(config["n_routed_experts"]):
            mlp_shapes(shapes, f"{m}.experts.{e}", h, config["moe_intermediate_size"])
        mlp_shapes(
            shapes,
            f"{m}.shared_experts",
            h,
            config["moe_intermediate_size"] * config["n_shared_experts"],
        )
    return shapes


def mlp_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, h: int, inter: int) -> None:
    shapes[f"{prefix}.gate_proj.weight"] = (inter, h)
    shapes[f"{prefix}.up_proj.weight"] = (inter, h)
    shapes[f"{prefix}.down_proj.weight"] = (h, inter)


def build_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The tiny DeepSeek's tensors (random_weights of its weight_shapes)."""
    return random_weights(weight_shapes(config), seed)


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """Norm weights 1, a router's correction bias small, every matrix N(0, INIT_STD); drawn in
    name order, so the same shapes and seed give the same tensors (every tiny test model)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=gen) * 0.01
        else:
            t = torch.randn(shape, generator=gen) * INIT_STD
        tensors[name] = t.contiguous()
    return tensors


def build_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE with VOCAB entries trained on _CORPUS, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "model_max_length": 2048,
                "chat_template": chat_template,
            },
            indent=2,
        )
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


def build_tiny_deepseek(
    out_dir: str | Path, version: int = 2, seed: int = 0, head_dim: int = QK_NOPE_HEAD_DIM
) -> Path:
    """Writes config.json, model.safetensors and a tokenizer into out_dir; returns out_dir.
    `head_dim`: qk_nope_head_dim and v_head_dim (GPU_HEAD_DIM for vLLM on GPU).

    Idempotent: a directory that already holds the same config and seed is left alone."""
    return write_checkpoint(
        out_dir,
        config_for(version, head_dim),
        seed,
        weight_shapes,
        "deepseek",
        f"DeepSeek-V{version}",
    )


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    seed: int,
    shapes_of: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]],
    family: str,
    label: str,
) -> Path:
    """Writes config.json, generation_config.json, model.safetensors (random_weights of
    shapes_of(config)) and the tokenizer into out_dir; returns out_dir. Idempotent: a directory
    that already holds the same config and seed is left alone."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    stamp = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    marker = out / f".tiny-{family}-stamp"
    if marker.is_file() and marker.read_text() == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
    weights = random_weights(shapes_of(config), seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(out)
    marker.write_text(stamp)
    log.info("wrote tiny %s to %s", label, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--version", type=int, default=2, choices=(2, 3))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=QK_NOPE_HEAD_DIM)
    args = parser.parse_args()
    print(build_tiny_deepseek(args.out_dir, args.version, args.seed, args.head_dim))


if __name__ == "__main__":
    main()
