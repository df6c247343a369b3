"""Seam: the platform's worker (`vllm/v1/worker/cpu_worker.py` `CPUWorker`,
`vllm/v1/worker/gpu_worker.py` `Worker`) and the V1 model runner class its `init_device`
builds.

Why: the AFD attention runner is vLLM's own V1 runner with a mixin in front, and vLLM builds
the runner inside `init_device` from a name it resolves then; that name is swapped for the
construction window only (`runner_class_swapped`).
Upstream change that makes it unnecessary: a `model_runner_cls` setting (as `worker_cls`
exists) or a runner factory a worker subclass can override on every platform.
Remove when: every supported line lets a worker pick its runner class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", ("self",)),
    ("vllm.v1.worker.gpu_worker", "Worker.init_device", ("self",)),
    ("vllm.distributed", "get_tensor_model_parallel_rank", ()),
    ("vllm.distributed", "tensor_model_parallel_all_reduce", ("input_",)),
    ("vllm.distributed", "get_tp_group", ()),
]


def current_platform() -> Any:
    from vllm.platforms import current_platform as platform

    return platform


def on_cpu() -> bool:
    return current_platform().device_type == "cpu"


def base_worker_class() -> Any:
    """The platform's worker class (what `--worker-cls auto` would pick)."""
    if on_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


@contextlib.contextmanager
def runner_class_swapped(make_runner_cls: Callable[[type], type]) -> Iterator[None]:
    """While the worker's init_device runs, vLLM's V1 model runner class resolves to
    make_runner_cls(that class); restored in `finally`.

    CPU: vllm/v1/worker/cpu_worker.py imports CPUModelRunner at module level and init_device
    builds `CPUModelRunner(...)`, so the module global is swapped. GPU: init_device (0.26) or
    Worker._make_model_runner (0.32) import GPUModelRunner from vllm.v1.worker.gpu_model_runner
    inside the method, so that module's attribute is swapped."""
    if on_cpu():
        from vllm.v1.worker import cpu_worker as module

        name = "CPUModelRunner"
    else:
        from vllm.v1.worker import gpu_model_runner as module

        name = "GPUModelRunner"
    original = getattr(module, name, None)
    if original is None:
        raise RuntimeError(f"{module.__name__}.{name} moved; vllm_ext (AFD) needs updating")
    setattr(module, name, make_runner_cls(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def tensor_parallel_all_reduce(tensor: Any) -> Any:
    """vLLM's own TP all-reduce (its CPU and CUDA communicators; captured in CUDA graphs as
    its model's all-reduces are): the sum over the TP group, as a new tensor."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor)


def tensor_parallel_sum_on_host(value: int) -> int:
    """The sum of `value` over the TP group, on its host-side (gloo) group: for settings the
    TP ranks must agree on at start-up."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    total = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(total, group=get_tp_group().cpu_group)
    return int(total.item())
