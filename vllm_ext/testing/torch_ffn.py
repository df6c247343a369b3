"""The tiny DeepSeek's FFN layers in plain torch, for the CUDA-graph test on a GPU machine that
has no vLLM (the lent H200): dense MLP for the first layer, then MoE (router, routed experts,
shared experts) with DeepSeek-V2 softmax or V3 sigmoid/noaux_tc routing.

Every expert runs on every token, weighted by the router's sparse mask: slower than a grouped
kernel but free of host synchronisation, so the whole layer can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _mlp(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ w[f"{prefix}.gate_proj.weight"].T
    up = x @ w[f"{prefix}.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


class TorchFfnStack:
    def __init__(self, config: dict[str, Any], weights: dict[str, torch.Tensor], device: str):
        self.config = config
        self.w = {k: v.to(device) for k, v in weights.items() if ".mlp." in k}
        self.num_layers = config["num_hidden_layers"]

    def router_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """What the attention side sends with gate=attention (zeros for a dense layer)."""
        p = f"model.layers.{layer}.mlp"
        if layer < self.config["first_k_dense_replace"]:
            return torch.zeros(x.shape[0], self.config["n_routed_experts"], device=x.device)
        return x @ self.w[f"{p}.gate.weight"].T

    def forward_layer(
        self, layer: int, x: torch.Tensor, router: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`router`: the router logits computed on the attention side (else computed here)."""
        c = self.config
        p = f"model.layers.{layer}.mlp"
        if layer < c["first_k_dense_replace"]:
            return _mlp(self.w, p, x)
        logits = router if router is not None else x @ self.w[f"{p}.gate.weight"].T
        experts = c["n_routed_experts"]
        if c["scoring_func"] == "softmax":
            scores = logits.softmax(dim=-1)
            weights, idx = scores.topk(c["num_experts_per_tok"], dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + self.w[f"{p}.gate.e_score_correction_bias"]
            groups = choice.view(x.shape[0], c["n_group"], experts // c["n_group"])
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(c["topk_group"], dim=-1).indices
            mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
            mask = mask.unsqueeze(-1).expand_as(groups).reshape(x.shape[0], experts)
            _, idx = choice.masked_fill(mask == 0, float("-inf")).topk(
                c["num_experts_per_tok"], dim=-1
            )
            weights = scores.gather(1, idx)
        if c["norm_topk_prob"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * c["routed_scaling_factor"]
        dense = torch.zeros(x.shape[0], experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, idx, weights.to(x.dtype))
        out = _mlp(self.w, f"{p}.shared_experts", x)
        for e in range(experts):
            out = out + dense[:, e : e + 1] * _mlp(self.w, f"{p}.experts.{e}", x)
        return out
