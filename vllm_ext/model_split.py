"""The AFD split, common to every model family (vllm_ext/families/ says per family where).

Attention role: the decoder layer's MLP/MoE is an `AfdFfnProxy`, a parameter-free module that
ships the post-attention-layernorm hidden states to the FFN side (through the `afd::ffn_exchange`
custom op, opaque to torch.compile) and returns its output. The op writes into an output tensor
the proxy allocates, as vLLM's attention ops do: under piecewise CUDA graphs the op runs eagerly
between two captured pieces, and the next piece reads its input from the address captured, which
must be a tensor the previous piece allocated (from the graph's memory pool), not a fresh one.
The checkpoint's FFN tensors are skipped at load. Embeddings, attention, layernorms, the final
norm and lm_head stay as vLLM built them.

FFN role: `FfnStack` holds only `model.layers.{i}.mlp` for every layer, built with the family's
vLLM classes (same kernels as a colocated run) and loaded with its vLLM loader from the FFN
tensors of the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm_ext import compat

log = logging.getLogger(__name__)

# What a proxy calls: layer_idx, hidden_states, router logits or None, output: writes the FFN
# output (shaped like hidden_states) into output. The attention worker binds its step state's
# `exchange` to every proxy (bind_proxies).
Exchange = Callable[[int, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


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


# -- FFN role ----------------------------------------------------------------------------
class _LayerHolder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


class FfnStack(nn.Module):
    """`layers[i].mlp` of every decoder layer, named as in the family's vLLM model, and
    nothing else."""

    def __init__(self, vllm_config: Any, prefix: str = "model") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.family = family(vllm_config.model_config.hf_config)
        self.config = config
        self.dtype = vllm_config.model_config.dtype
        self.n_routed_experts = self.family.num_routed_experts(config) or 0
        layers = []
        self.is_moe: list[bool] = []
        for i in range(config.num_hidden_layers):
            mlp, is_moe = self.family.build_ffn_layer(vllm_config, i, f"{prefix}.layers.{i}.mlp")
            layers.append(_LayerHolder(mlp))
            self.is_moe.append(is_moe)
        self.layers = nn.ModuleList(layers)
        # Router logits per layer for this call when the gate runs on the attention side.
        self._given: dict[int, torch.Tensor] | None = None
        self.family.prepare_ffn_stack(self, vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads the FFN tensors of a checkpoint (names as in the HF checkpoint)."""
        mine = (
            (name.removeprefix("model."), w)
            for name, w in weights
            if self.family.is_ffn_weight(name)
        )
        return self.family.load_ffn_weights(self, mine)

    def use_given_router_logits(self) -> None:
        """The gate runs on the attention side: every MoE layer's gate returns the logits
        passed to forward_layer instead of computing them (vLLM's MoE runner calls the very
        gate module the layer holds, so its forward is replaced on the instance)."""
        self._given = {}
        for i, holder in enumerate(self.layers):
            if self.is_moe[i]:
                holder.mlp.gate.forward = _GivenLogits(self._given, i)

    def forward_layer(
        self, layer_idx: int, hidden_states: torch.Tensor, router: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._given is not None and self.is_moe[layer_idx]:
            if router is None:
                raise RuntimeError(
                    f"afd ffn: gate=attention but layer {layer_idx} came without router logits"
                )
            self._given[layer_idx] = router
        out = self.layers[layer_idx].mlp(hidden_states)
        if not self.is_moe[layer_idx]:
            out = self.family.dense_output(self.config, out)
        return out


class _GivenLogits:
    """A MoE gate's forward on the FFN side when the attention side computed the logits."""

    def __init__(self, given: dict[int, torch.Tensor], layer_idx: int) -> None:
        self.given = given
        self.layer_idx = layer_idx

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits = self.given.pop(self.layer_idx, None)
        if logits is None or logits.shape[0] != hidden_states.shape[0]:
            raise RuntimeError(
                f"afd ffn: layer {self.layer_idx} has no router logits for its "
                f"{hidden_states.shape[0]} rows"
            )
        return logits, None


def load_ffn_stack(vllm_config: Any) -> FfnStack:
    """Builds the FFN half and loads its weights with vLLM's loader (not yet post-processed);
    call under set_current_vllm_config, then `finalize_ffn_stack`.

    `--load-format dummy`: vLLM's dummy loader fills the weights with random values, so the
    FFN half need not match the attention half's (also random) weights: for benchmarks only."""
    seams = compat.seams()
    model_config = vllm_config.model_config
    loader = seams.model_loader(vllm_config.load_config)
    device = torch.device(vllm_config.device_config.device)
    with seams.default_torch_dtype(model_config.dtype), device:
        stack = FfnStack(vllm_config)
    if str(vllm_config.load_config.load_format) == "dummy":
        loader.load_weights(stack, model_config)
        return stack
    expected = {n for n, _ in stack.named_parameters()}
    loaded = seams.loaded_parameter_names(
        stack.load_weights(loader.get_all_weights(model_config, stack))
    )
    missing = expected - loaded
    if missing:
        raise ValueError(
            f"afd ffn: checkpoint lacks {len(missing)} FFN tensors, e.g. {sorted(missing)[:3]}"
        )
    return stack


def mask_expert_shard(stack: FfnStack, shard: int, shards: int) -> None:
    """Keeps shard `shard` of `shards`: routed expert e iff e % shards == shard; the shared
    experts (if the family has them) and dense MLPs on shard 0. The others' down projections become zero, so each FFN
    rank returns a partial sum and the attention side adds them up.

    Memory is not saved yet (every rank loads every expert): that needs vLLM's expert
    parallel group across FFN servers."""
    if shards == 1:
        return
    if not 0 <= shard < shards:
        raise ValueError(f"afd ffn: expert shard {shard} of {shards}")
    n_routed = stack.n_routed_experts
    with torch.no_grad():
        for i, holder in enumerate(stack.layers):
            mlp = holder.mlp
            if not stack.is_moe[i]:
                if shard != 0:
                    mlp.down_proj.weight.zero_()
                continue
            w2 = next(p for n, p in mlp.experts.named_parameters() if n.endswith("w2_weight"))
            for e in range(w2.shape[0]):
                owner = e % shards if e < n_routed else 0  # fused shared experts: shard 0
                if owner != shard:
                    w2[e].zero_()
            shared = stack.family.shared_experts(mlp)
            if shared is not None and shard != 0:
                shared.down_proj.weight.zero_()


def finalize_ffn_stack(stack: FfnStack, vllm_config: Any, shard: int = 0, shards: int = 1) -> None:
    mask_expert_shard(stack, shard, shards)
    device = torch.device(vllm_config.device_config.device)
    compat.seams().process_weights_after_loading(stack, vllm_config.model_config, device)
    stack.eval()
    log.info(
        "afd ffn: %d FFN layers (%d MoE), %.1f M parameters, expert shard %d of %d",
        len(stack.layers),
        sum(stack.is_moe),
        sum(p.numel() for p in stack.parameters()) / 1e6,
        shard,
        shards,
    )
