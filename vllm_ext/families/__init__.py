"""The model families AFD splits: one module per family in this package, each defining `FAMILY`.

A family says where its decoder layer splits (what the attention side builds in place of the
MLP/MoE), which checkpoint tensors belong to the FFN side, and how the FFN side builds and
loads its MLP/MoE with vLLM's own classes. Modules here are found by name (pkgutil), so adding
a family is adding a module; vllm_ext/README.md says how.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import pkgutil
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm_ext import compat

log = logging.getLogger(__name__)


class Family:
    """One model family's AFD split. Subclasses set the class attributes and the methods that
    raise NotImplementedError; the rest are the common case (an `mlp` per decoder layer)."""

    name: str = ""
    # vLLM architectures (config.json `architectures`) this family splits.
    architectures: tuple[str, ...] = ()
    # The attention role's model: registered with vLLM's ModelRegistry under
    # `attention_architecture` ("module:Class"), and the attention role's config names it.
    # None: the family builds vLLM's own class inside `attention_load_window` instead.
    attention_architecture: str | None = None
    attention_model: str | None = None
    # Checkpoint tensors of the FFN side (skipped by the attention side), and the router gate's
    # (loaded by the attention side when the gate runs there). Group 2 of `ffn_weight` is the
    # layer index (vllm_ext.ffn.stack reads it).
    ffn_weight = re.compile(r"(^|\.)layers\.(\d+)\.mlp\.")
    gate_weight = re.compile(r"(^|\.)layers\.(\d+)\.mlp\.gate\.weight$")

    def attention_load_window(self, gate_here: bool) -> contextlib.AbstractContextManager[None]:
        """Where the attention model is built and loaded (vLLM's load_model runs inside)."""
        return contextlib.nullcontext()

    def num_routed_experts(self, config: Any) -> int | None:
        raise NotImplementedError

    def router_dtype(self, config: Any, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the router logits vLLM's gate returns."""
        raise NotImplementedError

    def is_moe_layer(self, config: Any, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a MoE (else a dense MLP)."""
        raise NotImplementedError

    def build_ffn_layer(
        self, vllm_config: Any, layer_idx: int, prefix: str, shared: bool = True
    ) -> tuple[nn.Module, bool]:
        """(layer `layer_idx`'s MLP or MoE built with vLLM's own class, whether it is a MoE).
        `shared=False`: a MoE without its shared experts (an FFN rank other than its group's
        first holds only routed experts)."""
        raise NotImplementedError

    def prepare_ffn_stack(self, stack: nn.Module, vllm_config: Any) -> None:
        """Sets what the family's load_weights reads from the model it runs on."""

    def load_ffn_weights(
        self, stack: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> set[str]:
        """Loads the FFN tensors (names without the `model.` prefix) with vLLM's loader."""
        raise NotImplementedError

    def dense_output(self, config: Any, out: torch.Tensor) -> torch.Tensor:
        """What the decoder layer does to a dense MLP's output before the residual add."""
        return out

    def is_ffn_weight(self, name: str) -> bool:
        return self.ffn_weight.search(name) is not None

    def is_gate_weight(self, name: str) -> bool:
        return self.gate_weight.search(name) is not None


@functools.cache
def families() -> tuple[Family, ...]:
    """Every module of this package that defines FAMILY, in name order."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    return tuple(found)


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in families() for a in f.architectures)


def family_for(hf_config: Any) -> Family:
    """The family of a model config (its vLLM or its AFD attention architecture); a model no
    family splits is refused with the list of those supported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for family in families():
        if any(a in family.architectures or a == family.attention_architecture for a in archs):
            return family
    raise ValueError(
        f"AFD supports {', '.join(supported_architectures())}; this model is {archs}. "
        "Serve one of those, or add a family (vllm_ext/README.md, 'Adding a model family')"
    )


def register_attention_models() -> None:
    """Registers every family's AFD attention model with vLLM's ModelRegistry (every vLLM
    process: the model is built in the engine core's or a worker's)."""
    for family in families():
        if family.attention_architecture and family.attention_model:
            compat.seams().register_model(family.attention_architecture, family.attention_model)


def use_attention_model(vllm_config: Any) -> None:
    """The attention role builds the family's AFD attention model: the config's architecture
    becomes the one the family registered (vLLM's loader resolves the class from it)."""
    hf_config = vllm_config.model_config.hf_config
    family = family_for(hf_config)
    if family.attention_architecture is None:
        return
    if list(hf_config.architectures) != [family.attention_architecture]:
        log.info(
            "afd attention: %s is built as %s (vllm_ext.families.%s)",
            hf_config.architectures,
            family.attention_architecture,
            family.name,
        )
        hf_config.architectures = [family.attention_architecture]
