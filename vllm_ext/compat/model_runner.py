"""Seam: the V1 model runner's private methods the AFD attention runner overrides
(`vllm/v1/worker/gpu_model_runner.py` `GPUModelRunner`: `_determine_batch_execution_and_padding`,
`_model_forward`, `_dummy_run`; CPUModelRunner inherits them) and the tuple the first returns;
its `execute_model`, only to settle a failed step's KV connector work (`kv_connector`; a step
whose verdict fails where its tokens are read keeps that work too).

`sample_tokens` is where a step's sampled tokens leave the runner: the AFD verdict of a
GPU-driven step (only enqueued when it closed) is checked where they are first read.
Why: `_determine_batch_execution_and_padding` is where vLLM fixes a step's padded token
counts (every DP rank's too) in execute_model and _dummy_run alike: the AFD step opens there,
so its payload travels while the inputs are prepared. `_model_forward` is the model call on
the runner's thread (a micro-batch thread's failure is raised there); `_dummy_run` says which
steps are profile, warm-up or capture runs.
Upstream change that makes it unnecessary: a runner hook "step shape decided" with the padded
counts and the step's kind (profile, warm-up, capture, replay), and one after the forward.
Remove when: every supported line has such hooks.
"""

from __future__ import annotations

import contextlib
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
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
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", ("self",)),
    ("vllm.v1.outputs", "AsyncModelRunnerOutput.get_output", ("self",)),
]


def check_before_tokens(output: Any, check: Any) -> Any:
    """Runs `check()` where vLLM first reads the sampled tokens in `output` (what
    GPUModelRunner.sample_tokens returned): at once for a ModelRunnerOutput (its tokens were
    synchronised inside sample_tokens), inside get_output() for an AsyncModelRunnerOutput (async
    scheduling: the copy is waited for there), after vLLM's own wait. A check that raises keeps
    the tokens from the scheduler, and so from every client."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    if not isinstance(output, AsyncModelRunnerOutput):
        _checked(output, check)
        return output
    get_output = output.get_output

    def checked_get_output() -> Any:
        result = get_output()
        _checked(result, check)
        return result

    output.get_output = checked_get_output
    return output


def _checked(output: Any, check: Any) -> None:
    """check(); a failed step's KV connector results (in its ModelRunnerOutput, which the
    failure keeps from the scheduler) go to the scheduler with the next step's output."""
    try:
        check()
    except BaseException:
        from vllm_ext.compat import kv_connector

        kv_connector.LIFECYCLE.strand(getattr(output, "kv_connector_output", None))
        raise


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


class RunnerSeam:
    """Mixed in front of the platform's V1 model runner (GPUModelRunner or CPUModelRunner,
    which inherits these): overrides the three private methods and calls the runner's hooks,
    which a subclass defines (vllm_ext.attention.worker)."""

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step; a step that raises (a failed AFD step) still settles its KV connector
        work (prefill/decode disaggregation: vllm_ext.compat.kv_connector says why)."""
        from vllm_ext.compat import kv_connector

        kv_connector.watch_kv_connector_lifecycle()
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        except Exception:
            kv_connector.settle_failed_step(scheduler_output, self.vllm_config)  # type: ignore[attr-defined]
            raise

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM decides the step's padded size (and, under DP, every rank's) here, before it
        builds attention metadata and inputs; execute_model and _dummy_run both pass here."""
        result = super()._determine_batch_execution_and_padding(*args, **kwargs)  # type: ignore[misc]
        return self.afd_padding_decided(result, args, kwargs)

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's model call, on the runner's thread (also under dual-batch overlap)."""
        output = super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        self.afd_forward_done()
        return output

    def _dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        """Profile, warm-up, capture and DP-padding runs; the flags say which."""
        with self.afd_dummy_run(
            is_profile=bool(kwargs.get("is_profile", False)),
            is_graph_capturing=bool(kwargs.get("is_graph_capturing", False)),
        ):
            return super()._dummy_run(num_tokens, *args, **kwargs)  # type: ignore[misc]

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM samples the step it ran; with async scheduling the tokens reach the host only
        in the output's get_output()."""
        output = super().sample_tokens(*args, **kwargs)  # type: ignore[misc]
        return self.afd_sampled(output)

    def afd_padding_decided(self, result: tuple, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """`result` of _determine_batch_execution_and_padding(*args, **kwargs) (read it with
        padding_decision); returns what the runner goes on with."""
        return result

    def afd_forward_done(self) -> None:
        """After the model call returned on the runner's thread."""

    def afd_sampled(self, output: Any) -> Any:
        """What sample_tokens returned; returns what vLLM goes on with."""
        return output

    def afd_dummy_run(self, is_profile: bool, is_graph_capturing: bool) -> Any:
        """A context manager around one dummy run."""
        return contextlib.nullcontext()
