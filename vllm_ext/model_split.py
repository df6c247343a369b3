"""The AFD split, common to every model family (vllm_ext/families/ says per family where).

Attention role: the decoder layer's MLP/MoE is an `AfdFfnProxy`, a parameter-free module that
ships the post-attention-layernorm hidden states to the FFN side (through the `afd::ffn_exchange`
custom op, opaque to torch.compile) and returns its output. The op writes into an output tensor
the proxy allocates, as vLLM's attention ops do: under piecewise CUDA graphs the op runs eagerly
between two captured pieces, and the next piece reads its input from the address captured, which
must be a tensor the previous piece allocated (from the graph's memory pool), not a fresh one.
The checkpoint's FFN tensors are skipped at load. Embeddings, attention, layernorms, the final
norm and lm_head stay as vLLM built them.

FFN role: vllm_ext.ffn.stack (the FFN half, and the slice of the experts one FFN rank holds).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vllm_ext import compat

log = logging.getLogger(__name__)

# What a proxy calls: layer_idx, hidden_states, router logits or None, output: writes the FFN
# output (shaped like hidden_states) into output. The attention worker binds its step state's
# `exchange` to every proxy (bind_proxies).
Exchange = Callable[[int, torch.Tensor, "torch.Tensor | None", torch.Tensor], object]


def layer_name(layer_idx: int) -> str:
    """The proxy's name in vLLM's per-layer registry (the op finds it by this name)."""
    return f"model.layers.{layer_idx}.mlp.afd_proxy"


@torch.library.custom_op("afd::ffn_exchange", mutates_args=("output",))
def ffn_exchange(
    hidden_states: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    router_logits: torch.Tensor | None = None,
) -> None:
    """Sends one layer's FFN input (and, with the gate on the attention side, its router
    logits) to the FFN side and writes its output into `output`. Finds its proxy by
    `layer_name` in the running forward's context, as vLLM's own layer ops do."""
    proxy = compat.seams().forward_layer(layer_name)
    if proxy.exchange is None:
        raise RuntimeError(
            "afd: an AFD attention model ran without an attention session (vllm_ext bug)"
        )
    proxy.exchange(proxy.layer_idx, hidden_states, router_logits, output)


@ffn_exchange.register_fake
def _ffn_exchange_fake(
    hidden_states: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    router_logits: torch.Tensor | None = None,
) -> None:
    return None


class AfdFfnProxy(nn.Module):
    """Stands where a decoder layer's MLP or MoE was. Holds no parameters, except the MoE
    router gate when it runs on the attention side (`gate`: vLLM's own GateLinear)."""

    def __init__(self, layer_idx: int, kind: str, gate: nn.Module | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = kind
        self.gate = gate
        self.layer_name = layer_name(layer_idx)
        # The worker's step state (AttentionSteps.exchange), bound once its session started.
        self.exchange: Exchange | None = None
        compat.seams().register_forward_layer(self.layer_name, self)

    def forward(
        self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False
    ) -> torch.Tensor:
        logits = self.gate(hidden_states)[0] if self.gate is not None else None
        output = torch.empty_like(hidden_states)
        torch.ops.afd.ffn_exchange(hidden_states, output, self.layer_name, logits)
        return output

    def extra_repr(self) -> str:
        gate = ", gate here" if self.gate is not None else ""
        return f"layer={self.layer_idx}, remote={self.kind}{gate}"


def family(hf_config: Any) -> Any:
    """The model's family (vllm_ext.families); an unsupported model is refused there."""
    from vllm_ext import families

    return families.family_for(hf_config)


def router_columns(hf_config: Any, model_dtype: torch.dtype, gate: str) -> tuple[int, str]:
    """(router_width, router_dtype) of the data plane: the router logits' columns when the
    gate runs on the attention side, else none."""
    if gate != "attention":
        return 0, "float32"
    split = family(hf_config)
    experts = split.num_routed_experts(hf_config)
    if not experts:
        raise ValueError("afd gate=attention needs a MoE model (it has no routed experts)")
    dtype = split.router_dtype(hf_config, model_dtype)
    return int(experts), str(dtype).removeprefix("torch.")


def attention_split(
    vllm_config: Any, gate_here: bool = False
) -> contextlib.AbstractContextManager[None]:
    """Construction and loading window for the attention role (a no-op for a family whose
    attention model is registered with vLLM). `gate_here`: the MoE proxies hold the router
    gate and its weights are loaded."""
    return family(vllm_config.model_config.hf_config).attention_load_window(gate_here)


def proxies(model: nn.Module) -> list[AfdFfnProxy]:
    return [m for m in model.modules() if isinstance(m, AfdFfnProxy)]


def bind_proxies(model: nn.Module, exchange: Exchange | None) -> None:
    """Points every proxy of `model` at the worker's step state (None: unbound)."""
    for proxy in proxies(model):
        proxy.exchange = exchange
