"""Seam: what vLLM's layers expect around them when the FFN role runs them outside a
worker (`vllm/config` `set_current_vllm_config`, `vllm/forward_context.py`
`set_forward_context`, `vllm/v1/worker/gpu_worker.py` `init_worker_distributed_environment`,
`vllm/v1/worker/workspace.py`).

Why: the FFN server has no vLLM worker, yet vLLM's MoE/MLP layers read the current config,
a forward context, the parallel groups and (on GPU) the workspace manager.
Upstream change that makes it unnecessary: an "FFN-only" worker or engine mode in vLLM.
Remove when: the FFN server can run as such a worker.
"""

from __future__ import annotations

from typing import Any

from vllm_ext.compat.worker import current_platform, on_cpu

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.config", "set_current_vllm_config", ("vllm_config",)),
    ("vllm.forward_context", "set_forward_context", ("attn_metadata", "vllm_config", "num_tokens")),
    (
        "vllm.v1.worker.gpu_worker",
        "init_worker_distributed_environment",
        ("vllm_config", "rank", "distributed_init_method", "local_rank", "backend"),
    ),
    ("vllm.distributed.parallel_state", "model_parallel_is_initialized", ()),
    ("vllm.v1.worker.workspace", "init_workspace_manager", ("device", "num_ubatches")),
]


def current_vllm_config(vllm_config: Any) -> Any:
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def forward_context(vllm_config: Any, num_tokens: int) -> Any:
    """The forward context vLLM's MoE/MLP layers read (no attention metadata)."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config, num_tokens=num_tokens)


def init_one_rank_world(vllm_config: Any, init_method: str) -> bool:
    """vLLM's parallel groups for a world of one, as a worker would set them up; False when
    they already exist."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    if model_parallel_is_initialized():
        return False
    init_worker_distributed_environment(
        vllm_config,
        rank=0,
        distributed_init_method=init_method,
        local_rank=0,
        backend=current_platform().dist_backend,
    )
    if not on_cpu():
        # vLLM's GPU MoE kernels take scratch memory from the workspace manager, which the GPU
        # worker's init_device sets up (vllm/v1/worker/workspace.py).
        import torch
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(torch.device("cuda", torch.cuda.current_device()), 1)
    return True
