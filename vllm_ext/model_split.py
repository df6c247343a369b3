"""The DeepSeek-V2/V3 split: which half of each decoder layer runs where.

Attention role: vLLM builds its own DeepseekV2ForCausalLM, but while each decoder layer is
constructed the names `DeepseekV2MoE` and `DeepseekV2MLP` in vLLM's model module resolve to
`AfdFfnProxy`, a parameter-free module that ships the post-attention-layernorm hidden states to
the FFN side (through the `afd::ffn_exchange` custom op, opaque to torch.compile) and returns
its output. The op writes into an output tensor the proxy allocates, as vLLM's attention ops
do: under piecewise CUDA graphs the op runs eagerly between two captured pieces, and the next
piece reads its input from the address captured, which must be a tensor the previous piece
allocated (from the graph's memory pool), not a fresh one. The checkpoint's `.mlp.` tensors are skipped at load. Embeddings, MLA attention,
layernorms, the final norm and lm_head stay as vLLM built them.

FFN role: `FfnStack` holds only `model.layers.{i}.mlp` for every layer, built with vLLM's own
DeepseekV2MoE/DeepseekV2MLP classes (same kernels as a colocated run) and loaded with vLLM's own
DeepseekV2Model.load_weights from the `.mlp.` tensors of the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_ext import compat

log = logging.getLogger(__name__)

MLP_WEIGHT = re.compile(r"(^|\.)layers\.(\d+)\.mlp\.")

MLP_GATE_WEIGHT = re.compile(r"(^|\.)layers\.(\d+)\.mlp\.gate\.weight$")

# Set by the attention worker: layer_idx, hidden_states, router logits or None -> FFN output
# of the same shape as hidden_states.
Exchange = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
_exchange: Exchange | None = None


def set_exchange(fn: Exchange | None) -> None:
    global _exchange
    _exchange = fn


@torch.library.custom_op("afd::ffn_exchange", mutates_args=("output",))
def ffn_exchange(
    hidden_states: torch.Tensor,
    output: torch.Tensor,
    layer_idx: int,
    router_logits: torch.Tensor | None = None,
) -> None:
    """Sends one layer's FFN input (and, with the gate on the attention side, its router
    logits) to the FFN side and writes its output into `output`."""
    if _exchange is None:
        raise RuntimeError(
            "afd: an AFD attention model ran without an attention session (vllm_ext bug)"
        )
    output.copy_(_exchange(layer_idx, hidden_states, router_logits))


@ffn_exchange.register_fake
def _ffn_exchange_fake(
    hidden_states: torch.Tensor,
    output: torch.Tensor,
    layer_idx: int,
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

    def forward(
        self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False
    ) -> torch.Tensor:
        logits = self.gate(hidden_states)[0] if self.gate is not None else None
        output = torch.empty_like(hidden_states)
        torch.ops.afd.ffn_exchange(hidden_states, output, self.layer_idx, logits)
        return output

    def extra_repr(self) -> str:
        gate = ", gate here" if self.gate is not None else ""
        return f"layer={self.layer_idx}, remote={self.kind}{gate}"


def router_columns(hf_config: Any, model_dtype: torch.dtype, gate: str) -> tuple[int, str]:
    """(router_width, router_dtype) of the data plane: the router logits' columns when the
    gate runs on the attention side, else none. vLLM's gate computes in the model's dtype
    unless the config asks for float32 routing."""
    if gate != "attention":
        return 0, "float32"
    _get_moe_router_dtype = compat.seams().deepseek_v2_module()._get_moe_router_dtype

    if getattr(hf_config, "n_routed_experts", None) is None:
        raise ValueError("afd gate=attention needs a MoE model (n_routed_experts is not set)")
    dtype = _get_moe_router_dtype(hf_config) or model_dtype
    return int(hf_config.n_routed_experts), str(dtype).removeprefix("torch.")


def _attention_gate(config: Any, prefix: str) -> nn.Module:
    """The MoE layer's router gate, built as DeepseekV2MoE builds it."""
    seams = compat.seams()
    return seams.gate_linear_class()(
        config.hidden_size,
        config.n_routed_experts,
        out_dtype=seams.deepseek_v2_module()._get_moe_router_dtype(config),
        prefix=f"{prefix}.gate",
    )


def _layer_idx(prefix: str) -> int:
    match = re.search(r"layers\.(\d+)\.mlp$", prefix)
    if match is None:
        raise ValueError(f"afd: cannot tell the layer of MLP prefix {prefix!r}")
    return int(match.group(1))


@contextlib.contextmanager
def attention_split(gate_here: bool = False) -> Iterator[None]:
    """Construction and loading window for the attention role (restored in `finally`).
    `gate_here`: the MoE proxies hold the router gate and its weights are loaded."""
    dsv2 = compat.seams().deepseek_v2_module()
    layer_cls = dsv2.DeepseekV2DecoderLayer
    original_init = layer_cls.__init__
    original_load = dsv2.DeepseekV2Model.load_weights
    moe_cls, mlp_cls = dsv2.DeepseekV2MoE, dsv2.DeepseekV2MLP

    def proxy_moe(*, prefix: str = "", config: Any = None, **_: Any) -> AfdFfnProxy:
        gate = _attention_gate(config, prefix) if gate_here else None
        return AfdFfnProxy(_layer_idx(prefix), "moe", gate)

    def proxy_mlp(*, prefix: str = "", **_: Any) -> AfdFfnProxy:
        return AfdFfnProxy(_layer_idx(prefix), "mlp")

    def layer_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        # Only inside a decoder layer's constructor: the model-level isinstance checks that run
        # afterwards see vLLM's real classes (so the attention model holds no MoE at all).
        dsv2.DeepseekV2MoE, dsv2.DeepseekV2MLP = proxy_moe, proxy_mlp  # type: ignore[assignment]
        try:
            original_init(self, *args, **kwargs)
        finally:
            dsv2.DeepseekV2MoE, dsv2.DeepseekV2MLP = moe_cls, mlp_cls

    def load_weights(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        kept = (
            (n, w)
            for n, w in weights
            if not MLP_WEIGHT.search(n) or (gate_here and MLP_GATE_WEIGHT.search(n))
        )
        return original_load(self, kept)

    layer_cls.__init__ = layer_init  # type: ignore[method-assign]
    dsv2.DeepseekV2Model.load_weights = load_weights  # type: ignore[method-assign]
    try:
        yield
    finally:
        layer_cls.__init__ = original_init  # type: ignore[method-assign]
        dsv2.DeepseekV2Model.load_weights = original_load  # type: ignore[method-assign]


def proxies(model: nn.Module) -> list[AfdFfnProxy]:
    return [m for m in model.modules() if isinstance(m, AfdFfnProxy)]


# -- FFN role ----------------------------------------------------------------------------
class _LayerHolder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


class FfnStack(nn.Module):
    """`layers[i].mlp` of every decoder layer, named as in DeepseekV2Model, and nothing else."""

    def __init__(self, vllm_config: Any, prefix: str = "model") -> None:
        super().__init__()
        seams = compat.seams()
        dsv2 = seams.deepseek_v2_module()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.dtype = vllm_config.model_config.dtype
        moe_layer_freq = getattr(config, "moe_layer_freq", 1)
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)
        layers = []
        self.is_moe: list[bool] = []
        for i in range(config.num_hidden_layers):
            mlp_prefix = f"{prefix}.layers.{i}.mlp"
            is_moe = (
                config.n_routed_experts is not None
                and i >= config.first_k_dense_replace
                and i % moe_layer_freq == 0
            )
            if is_moe:
                mlp: nn.Module = dsv2.DeepseekV2MoE(
                    config=config,
                    parallel_config=vllm_config.parallel_config,
                    quant_config=vllm_config.quant_config,
                    prefix=mlp_prefix,
                    apply_routed_scale_to_output=not dsv2.rocm_aiter_ops.is_fused_moe_enabled(),
                )
            else:
                mlp = dsv2.DeepseekV2MLP(
                    hidden_size=config.hidden_size,
                    intermediate_size=config.intermediate_size,
                    hidden_act=config.hidden_act,
                    quant_config=vllm_config.quant_config,
                    prefix=mlp_prefix,
                )
            layers.append(_LayerHolder(mlp))
            self.is_moe.append(is_moe)
        self.layers = nn.ModuleList(layers)
        # Router logits per layer for this call when the gate runs on the attention side.
        self._given: dict[int, torch.Tensor] | None = None
        # What DeepseekV2Model.load_weights reads from `self`.
        self.use_mha = False
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        self.is_fused_shared_expert_enabled = seams.fused_shared_expert_compatible(
            self.layers, dsv2.DeepseekV2MoE
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads the `.mlp.` tensors of a checkpoint (names as in the HF checkpoint)."""
        dsv2 = compat.seams().deepseek_v2_module()
        mine = ((name.removeprefix("model."), w) for name, w in weights if MLP_WEIGHT.search(name))
        return dsv2.DeepseekV2Model.load_weights(self, mine)  # type: ignore[arg-type]

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
        if not self.is_moe[layer_idx] and out.dtype == torch.float16:
            # What DeepseekV2DecoderLayer.forward does after a dense MLP in fp16.
            out = out * (1.0 / self.routed_scaling_factor)
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
    loaded = stack.load_weights(loader.get_all_weights(model_config, stack))
    missing = expected - loaded
    if missing:
        raise ValueError(
            f"afd ffn: checkpoint lacks {len(missing)} FFN tensors, e.g. {sorted(missing)[:3]}"
        )
    return stack


def mask_expert_shard(stack: FfnStack, shard: int, shards: int) -> None:
    """Keeps shard `shard` of `shards`: routed expert e iff e % shards == shard; the shared
    experts and dense MLPs on shard 0. The others' down projections become zero, so each FFN
    rank returns a partial sum and the attention side adds them up.

    Memory is not saved yet (every rank loads every expert): that needs vLLM's expert
    parallel group across FFN servers."""
    if shards == 1:
        return
    if not 0 <= shard < shards:
        raise ValueError(f"afd ffn: expert shard {shard} of {shards}")
    n_routed = stack.config.n_routed_experts
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
            if mlp.shared_experts is not None and shard != 0:
                mlp.shared_experts.down_proj.weight.zero_()


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
