"""Seam: vLLM's model registry, loader and the model classes the families build from
(`vllm/model_executor/models/registry.py`, `model_loader/`, `models/qwen3_moe.py`).

Why: the attention model of a family is registered under its own architecture name
(`ModelRegistry.register_model`), and the FFN role builds and loads only the MLP/MoE half
with vLLM's own classes, loader and weight post-processing. Nothing here is patched: these are
the public-ish names the families rely on, checked by tests/test_vllm_compat.py.
Upstream change that makes it unnecessary: none needed for the registry; a supported way to
build one layer's MLP/MoE of a model would replace the per-family FFN construction.
Remove when: never as a whole; each signature goes with the family code that uses it.
"""

from __future__ import annotations

from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM.load_weights", ("self",)),
    # @support_torch_compile hides the model's own __init__ behind (*args, vllm_config, prefix,
    # **kwargs): `decoder_layer_type` (vLLM's own parameter) is proven by the Qwen3-MoE AFD tests.
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeModel.__init__", ("vllm_config", "prefix")),
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeModel.load_weights", ("self", "weights")),
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeModel.hf_to_vllm_mapper", ()),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeDecoderLayer.forward",
        ("self", "positions", "hidden_states", "residual"),
    ),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeAttention.__init__",
        (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "rope_parameters",
            "max_position_embeddings",
            "rms_norm_eps",
            "qkv_bias",
            "head_dim",
            "cache_config",
            "quant_config",
            "prefix",
            "dual_chunk_attention_config",
        ),
    ),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeSparseMoeBlock.__init__",
        ("vllm_config", "prefix"),
    ),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeMLP.__init__",
        ("hidden_size", "intermediate_size", "hidden_act", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.qwen3_moe", "RMSNorm.__init__", ("hidden_size", "eps")),
    (
        "vllm.model_executor.models.qwen3_moe",
        "ParallelLMHead.__init__",
        ("num_embeddings", "embedding_dim", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.qwen3_moe", "LogitsProcessor.__init__", ("vocab_size",)),
    ("vllm.model_executor.models.qwen3_moe", "maybe_prefix", ("prefix", "name")),
    ("vllm", "ModelRegistry.register_model", ("model_arch", "model_cls")),
    ("vllm.model_executor.model_loader", "get_model_loader", ("load_config",)),
    (
        "vllm.model_executor.model_loader.utils",
        "process_weights_after_loading",
        ("model", "model_config", "target_device"),
    ),
    ("vllm.utils.torch_utils", "set_default_torch_dtype", ("dtype",)),
]


def model_module(name: str) -> Any:
    """vllm/model_executor/models/<name>.py: a model family's own classes, which the family's
    split (vllm_ext/families/) builds its halves from (their targets are in SIGNATURES)."""
    import importlib

    return importlib.import_module(f"vllm.model_executor.models.{name}")


def register_model(architecture: str, model_cls: str) -> None:
    """vLLM's ModelRegistry (vllm/model_executor/models/registry.py): `model_cls` is
    "module:Class", imported only when vLLM builds that architecture."""
    from vllm import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(architecture, model_cls)


def model_loader(load_config: Any) -> Any:
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(load_config)


def default_torch_dtype(dtype: Any) -> Any:
    from vllm.utils.torch_utils import set_default_torch_dtype

    return set_default_torch_dtype(dtype)


def process_weights_after_loading(model: Any, model_config: Any, device: Any) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading as process

    process(model, model_config, device)
