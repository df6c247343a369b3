"""Seam: vLLM's per-layer registry (`vllm/config/compilation.py`
`CompilationConfig.static_forward_context`, read back during a forward through
`vllm/forward_context.py` `get_forward_context().no_compile_layers`).

Why: the attention model's AFD exchange op (`afd::ffn_exchange`) finds its proxy, and through it
the worker's step state, by layer name, as vLLM's own attention and MoE ops find their layers:
no module global, one registry per engine, looked up in the forward that runs the op.
Upstream change that makes it unnecessary: none expected; this is vLLM's mechanism for custom
ops that must reach their layer.
Remove when: vLLM drops `static_forward_context` / `no_compile_layers`.
"""

from __future__ import annotations

from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.config", "get_current_vllm_config", ()),
    ("vllm.forward_context", "get_forward_context", ()),
    ("vllm.config.compilation", "CompilationConfig", ()),
]


def register_forward_layer(name: str, module: Any) -> None:
    """Registers `module` under `name` for the engine being built (called while vLLM builds
    the model, inside its current-config context); a duplicate name is an error, as in vLLM."""
    from vllm.config import get_current_vllm_config

    layers = get_current_vllm_config().compilation_config.static_forward_context
    if name in layers:
        raise ValueError(f"afd: duplicate layer name {name!r} in vLLM's forward context")
    layers[name] = module


def forward_layer(name: str) -> Any:
    """The module registered under `name`, from the running forward's context."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers[name]
