"""The FFN role's half of the model: `layers[i].mlp` of every decoder layer, and the slice of the
experts one FFN rank holds.

`FfnStack` holds only `model.layers.{i}.mlp`, built with the family's vLLM classes (same kernels
as a colocated run) and loaded with its vLLM loader from the FFN tensors of the checkpoint.

Expert parallelism (`ExpertShard`): the FFN ranks of one group split the model between them.
- Routed experts: vLLM's own expert-parallel placement (its expert map, its loader skipping other
  ranks' experts; compat's `expert_parallel_window`), so a rank allocates and computes about
  1/N of them and returns, for every row, the partial sum over its experts.
- Shared experts and dense MLPs: whole, on rank 0 only; the other ranks do not build them and
  return zeros for a dense layer. They are about 2% of DeepSeek-V3's FFN weights (3 dense layers
  and one shared expert per MoE layer against 256 routed ones), so rank 0 carries a little more.
  Splitting them tensor-parallel across the ranks would balance that (the combine is a sum
  anyway) but needs sharded loading in a world of one: left.
The attention side adds the N partial outputs in float32 and rounds once (afd_data.partial_sums).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from afd_ctl import routing
from vllm_ext import compat
from vllm_ext.model_split import family

log = logging.getLogger(__name__)

_SHARED = re.compile(r"(^|\.)layers\.\d+\.mlp\.shared_expert")
_ROUTED_PARAM = re.compile(r"\.mlp\.experts\.")


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """Rank `index` of the `count` FFN ranks that split one model's experts."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"afd ffn: expert shard {self.index} of {self.count}")

    @property
    def holds_shared(self) -> bool:
        """Shared experts and dense MLPs live on rank 0 of the group."""
        return self.index == 0

    def __str__(self) -> str:
        return f"expert shard {self.index} of {self.count}"


def can_serve(loaded: ExpertShard, shard: ExpertShard) -> bool:
    """A rank that loaded `loaded` can compute `shard`: the same one, or (issue 37) any shard
    0 of a group when it loaded every expert (rank 0 of a group also runs the shared experts
    and dense MLPs, which it holds)."""
    return shard == loaded or (loaded.count == 1 and shard.index == 0)


class _LayerHolder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


class NotHeld(nn.Module):
    """A dense MLP this rank does not hold (rank 0 of its group does): contributes zeros."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


class FfnStack(nn.Module):
    """`layers[i].mlp` of every decoder layer, named as in the family's vLLM model, and
    nothing else; with `shard.count > 1`, only this rank's slice of the experts."""

    def __init__(
        self, vllm_config: Any, shard: ExpertShard | None = None, prefix: str = "model"
    ) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.family = family(vllm_config.model_config.hf_config)
        self.shard = shard or ExpertShard()
        # The shard this rank computes now: its loaded one, or (issue 37) a narrower one of
        # its loaded experts after `afd-ctl scale` grew its group (`serve_shard`).
        self.serving = self.shard
        self.config = config
        self.dtype = vllm_config.model_config.dtype
        self.n_routed_experts = self.family.num_routed_experts(config) or 0
        layers = []
        self.is_moe: list[bool] = []
        self.held: list[bool] = []
        window = compat.seams().expert_parallel_window(self.shard.index, self.shard.count)
        with window:
            for i in range(config.num_hidden_layers):
                name = f"{prefix}.layers.{i}.mlp"
                if not self.family.is_moe_layer(config, i) and not self.shard.holds_shared:
                    mlp, is_moe = NotHeld(), False
                else:
                    mlp, is_moe = self.family.build_ffn_layer(
                        vllm_config, i, name, shared=self.shard.holds_shared
                    )
                layers.append(_LayerHolder(mlp))
                self.is_moe.append(is_moe)
                self.held.append(not isinstance(mlp, NotHeld))
        self.layers = nn.ModuleList(layers)
        # Router logits per layer for this call when the gate runs on the attention side.
        self._given: dict[int, torch.Tensor] | None = None
        self.loaded_bytes: dict[str, int] = {}
        self.family.prepare_ffn_stack(self, vllm_config)

    def holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is this rank's (an FFN tensor of a layer it holds;
        shared experts only on rank 0). Other ranks' routed experts are skipped by vLLM's
        loader itself (its expert map)."""
        match = self.family.ffn_weight.search(name)
        if match is None:
            return False
        if not self.held[int(match.group(2))]:
            return False
        return self.shard.holds_shared or _SHARED.search(name) is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads this rank's FFN tensors of a checkpoint (names as in the HF checkpoint)."""
        mine = ((name.removeprefix("model."), w) for name, w in weights if self.holds_weight(name))
        return self.family.load_ffn_weights(self, mine)

    def use_given_router_logits(self) -> None:
        """The gate runs on the attention side: every MoE layer's gate returns the logits
        passed to forward_layer instead of computing them (vLLM's MoE runner calls the very
        gate module the layer holds, so its forward is replaced on the instance)."""
        self._given = {}
        for i, holder in enumerate(self.layers):
            if self.is_moe[i]:
                mlp: Any = holder.mlp  # vLLM's MoE module
                mlp.gate.forward = _GivenLogits(self._given, i)

    def forward_layer(
        self, layer_idx: int, hidden_states: torch.Tensor, router: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._given is not None and self.is_moe[layer_idx]:
            if router is None:
                raise RuntimeError(
                    f"afd ffn: gate=attention but layer {layer_idx} came without router logits"
                )
            self._given[layer_idx] = router
        mlp: Any = self.layers[layer_idx].mlp
        out = mlp(hidden_states)
        if not self.is_moe[layer_idx] and self.held[layer_idx]:
            out = self.family.dense_output(self.config, out)
        return out

    def weight_bytes(self) -> dict[str, int]:
        """Parameter bytes this rank holds: routed experts, and everything else (gates, shared
        experts, dense MLPs). As loaded: vLLM's CPU kernels repack some weights into buffers
        when they are processed (finalize_ffn_stack keeps this count in `loaded_bytes`)."""
        routed = other = 0
        for name, p in self.named_parameters():
            size = p.numel() * p.element_size()
            if _ROUTED_PARAM.search(name):
                routed += size
            else:
                other += size
        return {"routed_experts": routed, "other": other, "total": routed + other}


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


def serve_shard(stack: FfnStack, shard: ExpertShard) -> None:
    """Issue 37, between steps: from the next step this rank computes `shard` of the experts
    (the one a new membership's routing gives it), narrowing its loaded experts. ValueError,
    saying what to do, when it did not load them."""
    if shard == stack.serving:
        return
    if not can_serve(stack.shard, shard):
        raise ValueError(
            f"afd ffn: the membership now needs {shard} of this rank, but it loaded "
            f"{stack.shard} and cannot compute other experts; restart it (it loads its shard "
            "of the membership afd-ctl has then)"
        )
    seams = compat.seams()
    if stack.n_routed_experts:
        if not seams.localize_cpu_routing(stack, masks=True):
            raise ValueError(
                f"afd ffn: moving from {stack.serving} to {shard} at run time is done on CPU "
                "only so far; on GPU restart the FFN servers at the new membership"
            )
        seams.narrow_experts(stack, shard.index, shard.count)
    log.info("afd ffn: now computing %s (loaded %s)", shard, stack.shard)
    stack.serving = shard


def load_ffn_stack(vllm_config: Any, shard: ExpertShard | None = None) -> FfnStack:
    """Builds this rank's FFN half and loads its weights with vLLM's loader (not yet
    post-processed); call under set_current_vllm_config, then `finalize_ffn_stack`.

    `--load-format dummy`: vLLM's dummy loader fills the weights with random values, so the
    FFN half need not match the attention half's (also random) weights: for benchmarks only."""
    seams = compat.seams()
    model_config = vllm_config.model_config
    loader = seams.model_loader(vllm_config.load_config)
    device = torch.device(vllm_config.device_config.device)
    with seams.default_torch_dtype(model_config.dtype), device:
        stack = FfnStack(vllm_config, shard)
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


def finalize_ffn_stack(stack: FfnStack, vllm_config: Any) -> None:
    device = torch.device(vllm_config.device_config.device)
    seams = compat.seams()
    stack.loaded_bytes = stack.weight_bytes()
    seams.process_weights_after_loading(stack, vllm_config.model_config, device)
    if stack.shard.count > 1:
        seams.localize_cpu_routing(stack)
    stack.eval()
    held = stack.loaded_bytes
    cuda = ""
    if device.type == "cuda":
        cuda = f"; cuda memory allocated {torch.cuda.memory_allocated(device)} bytes"
    experts = stack.n_routed_experts
    log.info(
        "afd ffn: %d FFN layers (%d MoE, %d held), %s: weights %d bytes (routed experts %d "
        "of %d: %d bytes; gates, shared experts, dense MLPs: %d bytes)%s",
        len(stack.layers),
        sum(stack.is_moe),
        sum(stack.held),
        stack.shard,
        held["total"],
        seams.local_expert_count(stack) if experts else 0,
        experts,
        held["routed_experts"],
        held["other"],
        cuda,
    )


def expert_shard(
    ffn_rank: int, num_attention: int, num_ffn: int, *, groups: int | None = None
) -> ExpertShard:
    """The expert shard of an FFN rank. afd-ctl routes attention rank a to FFN rank f iff
    a % g == f % g with g FFN groups (afd-ctl's --expert-parallel-size E: g = N / E; default
    min(M, N)); the FFN ranks of one group split the experts."""
    group = routing.ffn_group(ffn_rank, num_attention, num_ffn, groups=groups)
    return ExpertShard(group.index(ffn_rank), len(group))


def view_shard(ffn_rank: int, view: Any) -> ExpertShard:
    """The expert shard of an FFN rank in a control-plane view's membership (issue 37)."""
    m, n = view.expected_attention, view.expected_ffn
    return expert_shard(ffn_rank, m, n, groups=view.ffn_groups or None)
