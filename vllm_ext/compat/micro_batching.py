"""Seam: vLLM's dual-batch overlap at one data-parallel rank (`vllm/v1/worker/ubatch_utils.py`,
`gpu_ubatch_wrapper.py` `UBatchWrapper`, `vllm/forward_context.py` `DPMetadata`,
`vllm/v1/worker/ubatching.py`).

Why: vLLM 0.26 and 0.32 decide micro-batches only across DP ranks (they exist to overlap
DeepEP's all2all); AFD overlaps its FFN hop, which needs no second rank, so at DP 1 the same
rule is applied with vLLM's own pieces and the wrapper is let run (`micro_batched_at_one_rank`,
`allow_micro_batches_at_one_rank`); a step vLLM did not split at a size whose graph is
micro-batched runs without a graph, which the FFN side must be told (`graph_mode_run`); the
exchange hands over between micro-batches with vLLM's `dbo_yield` (`micro_batch`).
Upstream change that makes it unnecessary: micro-batching decided per rank (not only across
DP), with DPMetadata optional at DP 1.
Remove when: every supported line micro-batches at DP 1 by itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from vllm_ext.compat.model_runner import padding_decision

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
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
]


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


def graph_mode_run(runner: Any, graph_mode: str, num_tokens: int, micro_batched: bool) -> str:
    """The CUDA graph mode a step of `num_tokens` padded rows really runs in under
    --enable-dbo. vLLM's UBatchWrapper (runner.model) keeps one FULL graph per size: where it
    captured a size micro-batched, a step of that size that vLLM did not split (fewer real rows
    than its threshold, padded up to a micro-batched size) runs without a graph, although the
    step's forward context says FULL (UBatchWrapper.__call__: "ubatching was aborted")."""
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    if graph_mode != "FULL" or micro_batched or not isinstance(runner.model, UBatchWrapper):
        return graph_mode
    graphs = getattr(runner.model, "cudagraphs", None)
    if not isinstance(graphs, dict):
        raise RuntimeError(
            "afd: vLLM's UBatchWrapper keeps no `cudagraphs` dict of its micro-batched graphs; "
            "vllm_ext (AFD) needs updating for this vLLM"
        )
    return "NONE" if num_tokens in graphs else graph_mode


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
