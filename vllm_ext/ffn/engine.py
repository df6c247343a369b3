"""The FFN role's compute: vLLM's own MLP/MoE modules for every layer, outside any scheduler.

It sets up what those modules expect (a one-rank distributed world, the current vLLM config,
a forward context per call) and nothing else: no KV cache, no attention weights, no sampler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from vllm_ext import compat
from vllm_ext.ffn.stack import ExpertShard, FfnStack, finalize_ffn_stack, load_ffn_stack

log = logging.getLogger(__name__)


class FfnEngine:
    """Runs `layer`'s FFN over [tokens, hidden] inputs with the kernels a colocated run uses."""

    def __init__(
        self,
        vllm_config: Any,
        shard: ExpertShard | None = None,
        *,
        init_distributed: bool = True,
    ) -> None:
        """Builds and loads this rank's slice of the FFN half (`shard`: which of its group's
        FFN ranks it is; the whole model by default)."""
        self.vllm_config = vllm_config
        with compat.seams().current_vllm_config(vllm_config):
            if init_distributed:
                _init_one_rank_world(vllm_config)
            self.stack: FfnStack = load_ffn_stack(vllm_config, shard or ExpertShard())
            finalize_ffn_stack(self.stack, vllm_config)
        self._step_stack: contextlib.ExitStack | None = None
        self._step_rows: int | None = None
        config = vllm_config.model_config.hf_config
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        self.dtype: torch.dtype = vllm_config.model_config.dtype

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """One step: the forward context vLLM's modules need is set once (at the first layer)
        and kept for every layer with the same row count, instead of once per layer call."""
        with contextlib.ExitStack() as stack:
            self._step_stack, self._step_rows = stack, None
            try:
                yield
            finally:
                self._step_stack, self._step_rows = None, None

    @torch.inference_mode()
    def forward_layer(
        self, layer_idx: int, hidden_states: torch.Tensor, router: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`router`: the router logits when the gate runs on the attention side."""
        forward_context = compat.seams().forward_context
        rows = hidden_states.shape[0]
        if self._step_stack is not None and self._step_rows in (None, rows):
            if self._step_rows is None:
                self._step_stack.enter_context(forward_context(self.vllm_config, rows))
                self._step_rows = rows
            return self.stack.forward_layer(layer_idx, hidden_states, router)
        with forward_context(self.vllm_config, rows):
            return self.stack.forward_layer(layer_idx, hidden_states, router)


# Row counts at which kernels are specialised (vLLM's fused-MoE Triton configs are keyed by the
# batch size, and a new key compiles a new kernel): each is run once at start-up, and so is the
# odd count below each (Triton specialises integer arguments by divisibility by 16, and an odd
# row count makes the routed-token counts odd multiples of top_k: a prefill of any length).
WARM_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


def warm_sizes(max_rows: int) -> list[int]:
    """The row counts warm_up runs for steps of at most `max_rows` rows."""
    sizes = {n for n in WARM_ROWS if n <= max_rows} | {
        n - 1 for n in WARM_ROWS if 2 < n <= max_rows
    }
    return sorted(sizes)


@torch.inference_mode()
def warm_up(engine: FfnEngine, plane: Any, who: str) -> int:
    """Runs one layer of each kind (dense, MoE) at every WARM_ROWS size a step of `plane` (its
    attention peers' rows together) can have, so no kernel is compiled (Triton JIT) inside a
    served step: vLLM's own warm-up never runs the FFN server's layers. GPU only; returns the
    sizes run."""
    if not torch.cuda.is_available():
        return 0
    t0 = time.monotonic()
    config = plane.config
    attention = config.max_attention if config.elastic else config.num_attention
    max_rows = config.max_tokens_per_peer * attention
    router_width, router_dtype = config.router_width, plane.router_dtype
    kinds: dict[bool, int] = {}
    for layer in range(engine.num_layers):
        kinds.setdefault(engine.stack.is_moe[layer] and engine.stack.held[layer], layer)
    sizes = warm_sizes(max_rows)
    for rows in sizes:
        x = torch.randn(rows, engine.hidden_size, dtype=engine.dtype, device="cuda") * 0.02
        logits = None
        if router_width:
            logits = torch.randn(rows, router_width, dtype=router_dtype, device="cuda")
        for moe, layer in kinds.items():
            engine.forward_layer(layer, x, logits if moe else None)
    torch.cuda.synchronize()
    log.info(
        "afd ffn %s: warmed its layers at %d row counts up to %d in %.1f s",
        who,
        len(sizes),
        max_rows,
        time.monotonic() - t0,
    )
    return len(sizes)


def _init_one_rank_world(vllm_config: Any) -> None:
    """vLLM's parallel groups for a world of one (gloo on CPU, NCCL on GPU), as a worker would
    set them up. Its rendezvous store is a TCP store on a port the kernel picks as it binds
    (port 0): no file to leave behind if the server is killed, and no port chosen first and
    bound later, which another process could take in between."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    compat.seams().init_one_rank_world(vllm_config, "tcp://127.0.0.1:0")
