"""The attention role's worker and runner seam.

Worker: the platform's own worker class with one change: its model runner is our subclass of
the platform's runner. On GPU that is `Worker._make_model_runner` (vLLM's documented override
point); on CPU `CPUWorker.init_device` names `CPUModelRunner` directly, so the name is swapped
for the construction window only and restored in `finally`.

Runner: vLLM's own runner, with
- `load_model`: the model is built inside `model_split.attention_split()` (MLP/MoE become
  proxies), then the AFD session starts (data plane, registration, peers).
- `_determine_batch_execution_and_padding`: where vLLM fixes a step's padded token counts
  (every DP rank's too), in execute_model and _dummy_run alike: the AFD step opens there
  (data-plane state, then one published AFDControlPayload), so the payload's hop overlaps
  with input preparation. Two forward hooks then check the forward runs that step and close
  it. Every forward means every one: real steps, dummy and DP-padding runs, the
  memory-profiling run and compile warm-up.
- `_dummy_run`: only marks the step's flags (profile, warm-up, graph capture).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_ext.attention_session import AttentionSession, StepFlags
from vllm_ext.config import from_vllm_config
from vllm_ext.model_split import attention_split
from vllm_ext.step_failures import AfdStepFailed

log = logging.getLogger(__name__)


class AfdAttentionRunnerMixin:
    """Mixed in front of the platform's V1 model runner (GPUModelRunner or CPUModelRunner)."""

    _afd_session: AttentionSession | None = None
    _afd_flags: StepFlags | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        afd = from_vllm_config(self.vllm_config)  # type: ignore[attr-defined]
        if afd is None:
            raise RuntimeError("AfdAttentionWorker without an afd section in additional_config")
        with attention_split(gate_here=afd.gate == "attention"):
            super().load_model(*args, **kwargs)  # type: ignore[misc]
        session = AttentionSession(self.vllm_config, afd)  # type: ignore[attr-defined]
        session.start()
        self._afd_session = session
        model = self.model  # type: ignore[attr-defined]
        model.register_forward_pre_hook(self._afd_begin_step, with_kwargs=True)
        model.register_forward_hook(self._afd_end_step)

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM decides the step's padded size (and, under DP, every rank's) here, before it
        builds attention metadata and inputs: the AFD step opens now, so its payload travels
        while the attention side prepares. Both execute_model and _dummy_run pass here."""
        result = super()._determine_batch_execution_and_padding(*args, **kwargs)  # type: ignore[misc]
        num_tokens, across_dp, replaying = _padding_decision(result)
        flags = self._afd_flags or StepFlags()
        if not flags.is_graph_capturing and replaying:
            flags = flags.replaying()
        assert self._afd_session is not None
        self._afd_session.open_step(num_tokens, across_dp, flags)
        return result

    def _afd_begin_step(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        assert self._afd_session is not None
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is None:
            raise RuntimeError("afd: model forward without positions; cannot check the step")
        self._afd_session.check_forward(int(positions.shape[-1]))

    def _afd_end_step(self, module: Any, args: Any, output: Any) -> None:
        assert self._afd_session is not None
        self._afd_session.end_step()

    def _dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        is_profile = bool(kwargs.get("is_profile", False))
        self._afd_flags = StepFlags(
            is_warmup=not is_profile,
            is_profile=is_profile,
            is_graph_capturing=bool(kwargs.get("is_graph_capturing", False)),
        )
        try:
            return super()._dummy_run(num_tokens, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._afd_flags = None

    def afd_shutdown(self) -> None:
        if self._afd_session is not None:
            self._afd_session.close()
            self._afd_session = None


def _padding_decision(result: tuple) -> tuple[int, list[int] | None, bool]:
    """(padded rows, every DP rank's rows or None, replaying a CUDA graph) from what
    `_determine_batch_execution_and_padding` returned: vLLM 0.32 gives (cudagraph mode, batch
    descriptor, ubatch flag, num_tokens_across_dp, stats); read by type, not by position."""
    desc = next((r for r in result if type(r).__name__ == "BatchDescriptor"), None)
    mode = next((r for r in result if type(r).__name__ == "CUDAGraphMode"), None)
    if desc is None:
        raise RuntimeError(
            "vLLM's _determine_batch_execution_and_padding returned no BatchDescriptor; "
            "vllm_ext (AFD) needs updating for this vLLM"
        )
    across = next((r for r in result if isinstance(r, torch.Tensor)), None)
    rows = None if across is None else [int(n) for n in across.tolist()]
    return int(desc.num_tokens), rows, getattr(mode, "name", "NONE") != "NONE"


def _runner_cls(base: type) -> type:
    return type(f"AfdAttention{base.__name__}", (AfdAttentionRunnerMixin, base), {})


if current_platform.device_type == "cpu":
    from vllm.v1.worker import cpu_worker as _cpu_worker

    _BaseWorker: type = _cpu_worker.CPUWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _BaseWorker  # type: ignore[no-redef]


class AfdAttentionWorker(_BaseWorker):  # type: ignore[misc,valid-type]
    """The platform's worker whose model runner is the AFD attention runner."""

    def init_device(self) -> None:
        if current_platform.device_type != "cpu":
            return super().init_device()
        with _swap_cpu_runner():
            return super().init_device()

    def _make_model_runner(self) -> Any:  # GPU only (vLLM's override point)
        if getattr(self, "use_v2_model_runner", False):
            raise NotImplementedError(
                "AFD attention role on Model Runner V2 is not implemented yet; "
                "set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return _runner_cls(GPUModelRunner)(self.vllm_config, self.device)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(*args, **kwargs)
        except AfdStepFailed as exc:
            raise AfdStepFailed.reraise_short(exc) from None

    def execute_dummy_batch(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_dummy_batch(*args, **kwargs)
        except AfdStepFailed as exc:
            raise AfdStepFailed.reraise_short(exc) from None

    def afd_stats(self) -> dict[str, float]:
        """This rank's exchange split; `LLM.collective_rpc("afd_stats")` gathers it."""
        runner = getattr(self, "model_runner", None)
        session = getattr(runner, "_afd_session", None)
        return session.stats() if session is not None else {}

    def afd_stop(self) -> None:
        """Publishes stop and leaves afd-ctl (idempotent); vLLM's engine core calls it first."""
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, AfdAttentionRunnerMixin):
            runner.afd_shutdown()

    def shutdown(self) -> None:
        self.afd_stop()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()


@contextlib.contextmanager
def _swap_cpu_runner():
    original = _cpu_worker.CPUModelRunner
    if getattr(_cpu_worker, "CPUModelRunner", None) is None:
        raise RuntimeError("vllm.v1.worker.cpu_worker.CPUModelRunner moved; AFD needs updating")
    _cpu_worker.CPUModelRunner = _runner_cls(original)
    try:
        yield
    finally:
        _cpu_worker.CPUModelRunner = original
