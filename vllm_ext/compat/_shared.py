"""Reaches into vLLM internals that are the same on every supported line (0.26 and 0.32).

Each function names the vLLM source it reaches and why; the line modules (v0_26, v0_32)
re-export these and add what differs. `SIGNATURES` lists every callable target with the
parameters vllm_ext passes or overrides, for tests/test_vllm_compat.py. Heavy vLLM imports stay
inside the functions: importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.engine.arg_utils", "EngineArgs.add_cli_args", ("parser",)),
    ("vllm.engine.arg_utils", "EngineArgs.from_cli_args", ("args",)),
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config", ("self", "usage_context")),
    ("vllm.usage.usage_lib", "UsageContext.OPENAI_API_SERVER", ()),
    ("vllm.engine.arg_utils", "AsyncEngineArgs.from_cli_args", ("args",)),
    ("vllm.entrypoints.cli.serve", "ServeSubcommand.cmd", ("args",)),
    ("vllm.v1.engine.core", "EngineCore.shutdown", ("self",)),
    ("vllm.v1.engine.core", "EngineCore.step", ("self",)),
    ("vllm.v1.engine.core", "EngineCore.step_with_batch_queue", ("self",)),
    ("vllm.v1.engine.core", "EngineCore.execute_dummy_batch", ("self",)),
    ("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", ("self",)),
    ("vllm.v1.engine.core", "DPEngineCoreProc.run_busy_loop", ("self",)),
    ("vllm.v1.engine.async_llm", "AsyncLLM.check_health", ("self",)),
    (
        "vllm.entrypoints.generate.base.serving",
        "GenerateBaseServing._raise_if_error",
        ("self", "finish_reason", "request_id"),
    ),
    (
        "vllm.entrypoints.generate.base.serving",
        "GenerateBaseServing._convert_generation_error_to_streaming_response",
        ("self", "e"),
    ),
    (
        "vllm.entrypoints.generate.base.serving",
        "GenerateBaseServing.create_streaming_error_response",
        ("self", "message", "err_type", "status_code"),
    ),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", ("self",)),
    ("vllm.v1.worker.gpu_worker", "Worker.init_device", ("self",)),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._determine_batch_execution_and_padding",
        ("self", "num_tokens"),
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._dummy_run",
        ("self", "num_tokens", "is_profile", "is_graph_capturing"),
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.load_model", ("self",)),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward", ("self",)),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", ("self",)),
    ("vllm.model_executor.models.deepseek_v2", "DeepseekV2DecoderLayer.__init__", ("self",)),
    (
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2Model.load_weights",
        ("self", "weights"),
    ),
    (
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2MoE.__init__",
        ("config", "parallel_config", "quant_config", "prefix", "apply_routed_scale_to_output"),
    ),
    (
        "vllm.model_executor.models.deepseek_v2",
        "DeepseekV2MLP.__init__",
        ("hidden_size", "intermediate_size", "hidden_act", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.deepseek_v2", "_get_moe_router_dtype", ()),
    ("vllm.model_executor.models.deepseek_v2", "rocm_aiter_ops.is_fused_moe_enabled", ()),
    (
        "vllm.model_executor.layers.fused_moe.router.gate_linear",
        "GateLinear.__init__",
        ("input_size", "output_size", "out_dtype", "prefix"),
    ),
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM.load_weights", ("self",)),
    # @support_torch_compile hides the model's own __init__ behind (*args, vllm_config, prefix,
    # **kwargs): `decoder_layer_type` (vLLM's own parameter) is proven by the Qwen3-MoE AFD tests.
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeModel.__init__", ("vllm_config", "prefix")),
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeModel.load_weights", ("self", "weights")),
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeModel.hf_to_vllm_mapper", ()),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeDecoderLayer.forward",
        ("self", "positions", "hidden_states", "residual"),
    ),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeAttention.__init__",
        (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "rope_parameters",
            "max_position_embeddings",
            "rms_norm_eps",
            "qkv_bias",
            "head_dim",
            "cache_config",
            "quant_config",
            "prefix",
            "dual_chunk_attention_config",
        ),
    ),  # fmt: skip
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeSparseMoeBlock.__init__",
        ("vllm_config", "prefix"),
    ),
    (
        "vllm.model_executor.models.qwen3_moe",
        "Qwen3MoeMLP.__init__",
        ("hidden_size", "intermediate_size", "hidden_act", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.qwen3_moe", "RMSNorm.__init__", ("hidden_size", "eps")),
    (
        "vllm.model_executor.models.qwen3_moe",
        "ParallelLMHead.__init__",
        ("num_embeddings", "embedding_dim", "quant_config", "prefix"),
    ),
    ("vllm.model_executor.models.qwen3_moe", "LogitsProcessor.__init__", ("vocab_size",)),
    ("vllm.model_executor.models.qwen3_moe", "maybe_prefix", ("prefix", "name")),
    ("vllm", "ModelRegistry.register_model", ("model_arch", "model_cls")),
    ("vllm.model_executor.model_loader", "get_model_loader", ("load_config",)),
    (
        "vllm.model_executor.model_loader.utils",
        "process_weights_after_loading",
        ("model", "model_config", "target_device"),
    ),
    ("vllm.utils.torch_utils", "set_default_torch_dtype", ("dtype",)),
    ("vllm.utils.argparse_utils", "FlexibleArgumentParser", ()),
    ("vllm.config", "set_current_vllm_config", ("vllm_config",)),
    ("vllm.forward_context", "set_forward_context", ("attn_metadata", "vllm_config", "num_tokens")),
    (
        "vllm.v1.worker.gpu_worker",
        "init_worker_distributed_environment",
        ("vllm_config", "rank", "distributed_init_method", "local_rank", "backend"),
    ),
    ("vllm.distributed.parallel_state", "model_parallel_is_initialized", ()),
    ("vllm.v1.worker.workspace", "init_workspace_manager", ("device", "num_ubatches")),
    ("vllm.v1.worker.ubatching", "dbo_enabled", ()),
    ("vllm.v1.worker.ubatching", "dbo_current_ubatch_id", ()),
    ("vllm.v1.worker.ubatching", "dbo_yield", ()),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._determine_batch_execution_and_padding",
        (
            "self",
            "num_tokens",
            "num_reqs",
            "max_num_scheduled_tokens",
            "allow_microbatching",
            "force_uniform_decode",
        ),
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._is_uniform_decode",
        (
            "max_num_scheduled_tokens",
            "uniform_decode_query_len",
            "num_tokens",
            "num_reqs",
            "force_uniform_decode",
        ),
    ),
    (
        "vllm.v1.worker.ubatch_utils",
        "check_ubatch_thresholds",
        ("config", "num_tokens", "uniform_decode"),
    ),
    (
        "vllm.v1.worker.ubatch_utils",
        "is_last_ubatch_empty",
        ("orig_num_tokens", "padded_num_tokens", "num_ubatches"),
    ),
    ("vllm.v1.worker.gpu_ubatch_wrapper", "UBatchWrapper.__call__", ("self",)),
    (
        "vllm.forward_context",
        "DPMetadata.make",
        ("parallel_config", "num_tokens", "num_tokens_across_dp_cpu"),
    ),
    ("vllm.forward_context", "get_forward_context", ()),
    ("vllm.distributed", "get_tensor_model_parallel_rank", ()),
    ("vllm.v1.engine", "EngineCoreOutput", ()),
    ("vllm.v1.engine", "EngineCoreOutputs", ()),
    ("vllm.v1.request", "RequestStatus.FINISHED_ERROR", ()),
    ("vllm.v1.engine.exceptions", "EngineDeadError", ()),
    ("vllm.config.compilation", "CUDAGraphMode.PIECEWISE", ()),
    ("vllm.config.compilation", "CompilationMode.VLLM_COMPILE", ()),
    ("vllm", "LLM.generate", ("self", "prompts", "sampling_params")),
    ("vllm", "SamplingParams", ()),
]


# -- entry points the hooks wrap --------------------------------------------------------------
def engine_args_classes() -> tuple[type, type]:
    """(EngineArgs, AsyncEngineArgs): vllm/engine/arg_utils.py; their add_cli_args,
    from_cli_args and create_engine_config are where flags and the engine config are made."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    return EngineArgs, AsyncEngineArgs


def serve_usage_context() -> Any:
    """What `vllm serve` passes to create_engine_config (vllm/usage/usage_lib.py): some
    defaults (max_num_batched_tokens on GPU) depend on it, and the FFN server must size its data
    plane exactly as the attention `vllm serve` does."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def offline_llm_classes() -> tuple[type, type]:
    """(LLM, SamplingParams): vLLM's public offline API, for vllm_ext.testing's reference and
    benchmark runs (public, but reached here like everything else of vLLM)."""
    from vllm import LLM, SamplingParams

    return LLM, SamplingParams


def flexible_argument_parser() -> type:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser


def loaded_serve_module() -> ModuleType | None:
    """vllm/entrypoints/cli/serve.py, only where the `vllm` CLI already imported it (plugins
    load after it there); ServeSubcommand.cmd is what `vllm serve` runs."""
    return sys.modules.get("vllm.entrypoints.cli.serve")


def loaded_engine_core_module() -> ModuleType | None:
    """vllm/v1/engine/core.py, only in engine-core processes (they load plugins from
    EngineCore.__init__): EngineCore.step/step_with_batch_queue/execute_dummy_batch/shutdown
    and the busy loops of EngineCoreProc/DPEngineCoreProc."""
    return sys.modules.get("vllm.v1.engine.core")


def api_server_classes() -> tuple[type, type]:
    """(AsyncLLM, GenerateBaseServing): `check_health` answers /health; `_raise_if_error`
    turns a request finished with an error into the HTTP error, and
    `_convert_generation_error_to_streaming_response` into a stream's error event."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM, GenerateBaseServing


def engine_dead_error() -> type[Exception]:
    """vLLM's /health route answers 503 for this class (vllm/v1/engine/exceptions.py)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def finish_requests_with_error(scheduler: Any, request_ids: list[str]) -> list[Any]:
    """The scheduler's own way of ending requests (vllm/v1/core/sched/scheduler.py)."""
    from vllm.v1.request import RequestStatus

    return list(scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR))


def engine_core_outputs_classes() -> tuple[type, type]:
    """(EngineCoreOutput, EngineCoreOutputs): what EngineCore.step returns per client."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    return EngineCoreOutput, EngineCoreOutputs


# -- the attention worker and its runner ------------------------------------------------------
def current_platform() -> Any:
    from vllm.platforms import current_platform as platform

    return platform


def on_cpu() -> bool:
    return current_platform().device_type == "cpu"


def base_worker_class() -> type:
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
        from vllm.v1.worker import gpu_model_runner as module  # type: ignore[no-redef]

        name = "GPUModelRunner"
    original = getattr(module, name, None)
    if original is None:
        raise RuntimeError(f"{module.__name__}.{name} moved; vllm_ext (AFD) needs updating")
    setattr(module, name, make_runner_cls(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def padding_decision(result: tuple) -> tuple[int, list[int] | None, str, bool]:
    """(padded rows, every DP rank's rows or None, CUDA graph runtime mode name, whether the
    step runs as micro-batches) from what GPUModelRunner._determine_batch_execution_and_padding
    returned: (cudagraph mode, batch descriptor, ubatch flag, num_tokens_across_dp, stats) on
    both lines; read by type, not by position, so a reordering fails clearly instead of
    silently."""
    import torch

    desc = next((r for r in result if type(r).__name__ == "BatchDescriptor"), None)
    mode = next((r for r in result if type(r).__name__ == "CUDAGraphMode"), None)
    ubatch = [r for r in result if isinstance(r, bool)]
    if desc is None or len(ubatch) != 1:
        raise RuntimeError(
            "vLLM's _determine_batch_execution_and_padding returned no BatchDescriptor or no "
            "single ubatch flag; vllm_ext (AFD) needs updating for this vLLM"
        )
    across = next((r for r in result if isinstance(r, torch.Tensor)), None)
    rows = None if across is None else [int(n) for n in across.tolist()]
    return int(desc.num_tokens), rows, getattr(mode, "name", "NONE"), ubatch[0]


def micro_batched_at_one_rank(runner: Any, result: tuple, args: tuple, kwargs: dict) -> tuple:
    """`result` of GPUModelRunner._determine_batch_execution_and_padding(*args, **kwargs) with
    its ubatch flag set as vLLM would set it across DP ranks, for a runner at DP 1.

    vLLM 0.26 and 0.32 decide micro-batching only across DP ranks (the runner calls
    coordinate_batch_across_dp only under DP > 1), because their micro-batches exist to overlap
    DeepEP's all2all. An AFD attention server overlaps its FFN hop instead, which needs no
    second rank: the same rule is applied here with vLLM's own pieces (check_ubatch_thresholds,
    is_last_ubatch_empty) on this rank's padded size."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds, is_last_ubatch_empty

    bound = _padding_signature().bind(runner, *args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    padded, _, _, micro_batched = padding_decision(result)
    if micro_batched or not call["allow_microbatching"]:
        return result
    parallel = runner.parallel_config
    uniform = GPUModelRunner._is_uniform_decode(
        max_num_scheduled_tokens=call["max_num_scheduled_tokens"],
        uniform_decode_query_len=runner.uniform_decode_query_len,
        num_tokens=call["num_tokens"],
        num_reqs=call["num_reqs"],
        force_uniform_decode=call["force_uniform_decode"],
    )
    if not check_ubatch_thresholds(parallel, call["num_tokens"], uniform_decode=uniform):
        return result
    if is_last_ubatch_empty(call["num_tokens"], padded, parallel.num_ubatches):
        return result
    return tuple(True if isinstance(r, bool) else r for r in result)


@functools.cache
def _padding_signature() -> inspect.Signature:
    """GPUModelRunner._determine_batch_execution_and_padding's signature (read once: the
    micro-batch decision binds every step's arguments to it)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return inspect.signature(GPUModelRunner._determine_batch_execution_and_padding)


def allow_micro_batches_at_one_rank(runner: Any) -> None:
    """Lets vLLM's UBatchWrapper (runner.model under --enable-dbo) run micro-batches at DP 1.

    It asserts that the step's forward context has DP metadata and builds each micro-batch's
    with DPMetadata.make, which asserts DP > 1 (vllm/v1/worker/gpu_ubatch_wrapper.py,
    vllm/forward_context.py). Only MoE layers read that metadata and an AFD attention model has
    none, so at DP 1 it is filled with this rank's own counts: the wrapper instance's class
    becomes a subclass that fills the step's metadata, and the wrapper module's DPMetadata a
    subclass whose make accepts DP 1. Both still defer to vLLM at DP > 1."""
    import torch
    from vllm.forward_context import DPMetadata, get_forward_context
    from vllm.v1.worker import gpu_ubatch_wrapper

    wrapper = runner.model
    if not isinstance(wrapper, gpu_ubatch_wrapper.UBatchWrapper):
        raise RuntimeError(
            f"afd: --enable-dbo but vLLM built {type(wrapper).__name__}, not its UBatchWrapper; "
            "vllm_ext (AFD) needs updating for this vLLM"
        )
    if not issubclass(gpu_ubatch_wrapper.DPMetadata, _OneRankDPMetadata):
        gpu_ubatch_wrapper.DPMetadata = type(
            "OneRankDPMetadata", (_OneRankDPMetadata, DPMetadata), {}
        )

    class OneRankUBatchWrapper(type(wrapper)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            context = get_forward_context()
            if context.ubatch_slices is not None and context.dp_metadata is None:
                rows = sum(s.num_tokens for s in context.ubatch_slices)
                context.dp_metadata = DPMetadata(torch.tensor([rows], dtype=torch.int32))
            return super().__call__(*args, **kwargs)

    wrapper.__class__ = OneRankUBatchWrapper


class _OneRankDPMetadata:
    """Mixed in front of vLLM's DPMetadata (see allow_micro_batches_at_one_rank)."""

    @staticmethod
    def make(parallel_config: Any, num_tokens: int, num_tokens_across_dp_cpu: Any) -> Any:
        from vllm.forward_context import DPMetadata

        if parallel_config.data_parallel_size == 1:
            return DPMetadata(num_tokens_across_dp_cpu)
        return DPMetadata.make(parallel_config, num_tokens, num_tokens_across_dp_cpu)


def pin_v1_model_runner() -> str | None:
    """The AFD attention runner subclasses vLLM's V1 GPU runner; vLLM 0.26+ picks Model Runner
    V2 by default for some architectures (vllm/config/vllm.py `use_v2_model_runner`, which
    reads VLLM_USE_V2_MODEL_RUNNER first). Pins V1 through that variable, which the engine-core
    and worker processes inherit. Returns what was done, for the log, or raises if the user
    asked for V2 explicitly."""
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if asked is not None and asked.strip().lower() in ("1", "true", "yes"):
        raise ValueError(
            "AFD's attention role runs on vLLM's V1 model runner; VLLM_USE_V2_MODEL_RUNNER=1 "
            "asks for V2, which it does not support yet: unset it"
        )
    if asked is None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        return "VLLM_USE_V2_MODEL_RUNNER=0 (the AFD attention runner is vLLM's V1 runner)"
    return None


# -- CUDA graphs and compilation --------------------------------------------------------------
def compilation_enums() -> tuple[type, type]:
    """(CUDAGraphMode, CompilationMode): vllm/config/compilation.py."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return CUDAGraphMode, CompilationMode


# -- model split (DeepSeek V2/V3) -------------------------------------------------------------
def deepseek_v2_module() -> ModuleType:
    """vllm/model_executor/models/deepseek_v2.py: DeepseekV2DecoderLayer (its constructor
    builds `DeepseekV2MoE`/`DeepseekV2MLP` by module-global name), DeepseekV2Model.load_weights,
    _get_moe_router_dtype, rocm_aiter_ops."""
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2


def model_module(name: str) -> ModuleType:
    """vllm/model_executor/models/<name>.py: a model family's own classes, which the family's
    split (vllm_ext/families/) builds its halves from (their targets are in SIGNATURES)."""
    import importlib

    return importlib.import_module(f"vllm.model_executor.models.{name}")


def register_model(architecture: str, model_cls: str) -> None:
    """vLLM's ModelRegistry (vllm/model_executor/models/registry.py): `model_cls` is
    "module:Class", imported only when vLLM builds that architecture."""
    from vllm import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(architecture, model_cls)


def gate_linear_class() -> type:
    """The MoE router gate DeepseekV2MoE builds (returns (logits, bias))."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return GateLinear


def model_loader(load_config: Any) -> Any:
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(load_config)


def default_torch_dtype(dtype: Any) -> Any:
    from vllm.utils.torch_utils import set_default_torch_dtype

    return set_default_torch_dtype(dtype)


def process_weights_after_loading(model: Any, model_config: Any, device: Any) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading as process

    process(model, model_config, device)


# -- what vLLM's layers expect around them (the FFN role) -------------------------------------
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


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _stay() -> None:
    """Outside micro-batching there is no other micro-batch to hand over to."""


def micro_batch() -> tuple[int, Callable[[], None]]:
    """The micro-batch this thread runs under vLLM's dual-batch overlap (one thread per
    micro-batch, one running at a time) and the call that lets the other one run until it
    yields back; (0, a no-op) outside micro-batching."""
    from vllm.v1.worker import ubatching

    if not ubatching.dbo_enabled():
        return 0, _stay
    return ubatching.dbo_current_ubatch_id(), ubatching.dbo_yield
