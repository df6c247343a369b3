"""The attention role's worker and runner seam.

Worker: the platform's own worker class with one change: its model runner is our subclass of
the platform's V1 runner. The worker's init_device builds the runner from a class name vLLM
resolves at that moment; `compat.runner_class_swapped` points that name at our subclass for
the construction window only (restored in `finally`).

Runner: vLLM's own runner, with (the private-method overrides themselves are compat's
`RunnerSeam`, which calls the `afd_*` hooks here)
- `load_model`: vLLM builds the family's attention model (vllm_ext/families: MLP/MoE become
  proxies) inside `model_split.attention_split()`, then the AFD session starts (data plane,
  registration, peers).
- `_determine_batch_execution_and_padding` (`afd_padding_decided`): where vLLM fixes a step's
  padded token counts (every DP rank's too), in execute_model and _dummy_run alike: the AFD
  step opens there (data-plane state, then one published AFDControlPayload), so the payload's
  hop overlaps with input preparation. Two forward hooks then check the forward runs that step and close
  it. Every forward means every one: real steps, dummy and DP-padding runs, the
  memory-profiling run and compile warm-up. Under --enable-dbo the hooks run once per
  micro-batch, and at DP 1 AFD makes the micro-batch decision vLLM makes only across DP ranks
  (compat.micro_batched_at_one_rank).
- `_dummy_run` (`afd_dummy_run`): only marks the step's flags (profile, warm-up, graph
  capture); `_model_forward` (`afd_forward_done`): a micro-batch thread's failure is raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from afd_ctl.step import StepFlags
from vllm_ext import compat, hooks, model_split
from vllm_ext.attention import tp_group
from vllm_ext.attention.session import AttentionSession
from vllm_ext.attention.step_failures import AfdStepFailed
from vllm_ext.config import from_vllm_config
from vllm_ext.model_split import attention_split

log = logging.getLogger(__name__)


class AfdAttentionRunnerMixin(compat.seams().RunnerSeam):  # type: ignore[misc]
    """Mixed in front of the platform's V1 model runner (GPUModelRunner or CPUModelRunner);
    compat's RunnerSeam overrides vLLM's private methods and calls the afd_* hooks below."""

    _afd_session: AttentionSession | None = None
    _afd_flags: StepFlags | None = None
    # Set while the worker runs a DP idle rank's dummy batch: a serving step, not a warm-up.
    _afd_serving_dummy = False
    # --enable-dbo at DP 1: AFD makes vLLM's micro-batch decision (compat.micro_batched_at_one_rank).
    _afd_one_rank_micro_batches = False
    # --enable-dbo at any DP: unsplit steps may run eagerly (compat.graph_mode_run).
    _afd_micro_batches = False

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        afd = from_vllm_config(self.vllm_config)
        if afd is None:
            raise RuntimeError("AfdAttentionWorker without an afd section in additional_config")
        with attention_split(self.vllm_config, gate_here=afd.gate == "attention"):
            super().load_model(*args, **kwargs)
        built = self.get_model()
        if not model_split.proxies(built):
            raise RuntimeError(
                f"afd attention: vLLM built {type(built).__name__} with no AFD proxy, so "
                "it would run every FFN here; its family module (vllm_ext/families) must "
                "split it: see vllm_ext/README.md, 'Adding a model family'"
            )
        parallel = self.vllm_config.parallel_config
        self._afd_micro_batches = parallel.use_ubatching
        self._afd_one_rank_micro_batches = (
            parallel.use_ubatching and parallel.data_parallel_size == 1
        )
        if self._afd_one_rank_micro_batches:
            compat.seams().allow_micro_batches_at_one_rank(self)
        session = AttentionSession(self.vllm_config, afd)
        session.start()
        self._afd_session = session
        steps = session._steps
        exchange: model_split.Exchange | None = steps.exchange if steps is not None else None
        if session.tp_size > 1:  # one exchange per TP group (vllm_ext.attention.tp_group)
            session.set_full_graphs(
                tp_group.agreed_full_graphs(session.full_graphs if session.leader else None)
            )
            exchange = tp_group.group_exchange(exchange)
        model_split.bind_proxies(built, exchange)  # the op finds them by name
        # The exchange is known now, before vLLM resolves its CUDA graph mode (at KV cache
        # set-up): FULL graphs need one that only enqueues GPU work.
        hooks.graphs_for_exchange(self.vllm_config, session.full_graphs)
        # On the model itself, not on vLLM's wrapper (UBatchWrapper under --enable-dbo): under
        # dual-batch overlap the hooks run once per micro-batch.
        built.register_forward_pre_hook(self._afd_begin_step, with_kwargs=True)
        built.register_forward_hook(self._afd_end_step)

    def afd_padding_decided(self, result: tuple, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """vLLM decided the step's padded size (and, under DP, every rank's), before it builds
        attention metadata and inputs: the AFD step opens now, so its payload travels while
        the attention side prepares. Both execute_model and _dummy_run pass here."""
        if self._afd_one_rank_micro_batches:  # vLLM decides micro-batches only under DP > 1
            result = compat.seams().micro_batched_at_one_rank(self, result, args, kwargs)
        num_tokens, across_dp, graph_mode, micro_batched = compat.seams().padding_decision(result)
        if self._afd_micro_batches:  # an unsplit step at a micro-batched graph's size: eager
            graph_mode = compat.seams().graph_mode_run(self, graph_mode, num_tokens, micro_batched)
        flags = self._afd_flags or StepFlags()
        stage_tokens = None
        if micro_batched:
            # Dual-batch overlap: vLLM splits the padded rows in two (the second half takes
            # the odd row) and runs the micro-batches eagerly here (it captures micro-batched
            # graphs only in FULL mode, which AFD does not use). The FFN side still replays a
            # graph per stage (vllm_ext/exchange/nixl_graphs.py captures a stage's first one then).
            stage_tokens = [num_tokens // 2, num_tokens - num_tokens // 2]
        if not flags.is_graph_capturing and graph_mode != "NONE":
            flags = flags.replaying()
        assert self._afd_session is not None
        self._afd_session.steps.open_step(
            num_tokens, across_dp, flags, stage_tokens, full_graph=graph_mode == "FULL"
        )
        return result

    def afd_forward_done(self) -> None:
        """After vLLM's model call, on the runner's thread: a failure inside a micro-batch's
        thread (dual-batch overlap) fails the step here, before its outputs are sampled."""
        assert self._afd_session is not None
        self._afd_session.steps.raise_stage_failure()
        self._afd_session.steps.finish_forward()  # a replayed FULL graph ran no forward hooks

    def afd_sampled(self, output: Any) -> Any:
        """vLLM sampled the last step (sample_tokens returned `output`): the verdict of the
        steps closed since the previous sampling is checked where their tokens are first read
        (at once for a synchronous output, inside get_output for an asynchronous one)."""
        assert self._afd_session is not None
        verdict = self._afd_session.steps.take_verdict()
        return compat.seams().check_before_tokens(output, verdict)

    def _afd_begin_step(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        assert self._afd_session is not None
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if positions is None:
            raise RuntimeError("afd: model forward without positions; cannot check the step")
        self._afd_session.steps.check_forward(int(positions.shape[-1]))

    def _afd_end_step(self, module: Any, args: Any, output: Any) -> None:
        assert self._afd_session is not None
        self._afd_session.steps.end_step()

    @contextlib.contextmanager
    def afd_dummy_run(self, is_profile: bool, is_graph_capturing: bool) -> Iterator[None]:
        """Around vLLM's _dummy_run: the flags of the step it opens."""
        self._afd_flags = StepFlags(
            is_warmup=not is_profile and not self._afd_serving_dummy,
            is_profile=is_profile,
            is_graph_capturing=is_graph_capturing,
        )
        try:
            yield
            if self._afd_session is not None:
                self._afd_session.steps.finish_forward()  # a replayed FULL graph ran no hooks
                self._afd_session.steps.settle_now()  # no sampling follows a dummy run
        finally:
            self._afd_flags = None

    def afd_shutdown(self) -> None:
        if self._afd_session is not None:
            self._afd_session.close()
            self._afd_session = None


def _runner_cls(base: type) -> type:
    return type(f"AfdAttention{base.__name__}", (AfdAttentionRunnerMixin, base), {})


_BaseWorker: type = compat.seams().base_worker_class()


class AfdAttentionWorker(_BaseWorker):
    """The platform's worker whose model runner is the AFD attention runner."""

    def init_device(self) -> None:
        if getattr(self, "use_v2_model_runner", False):
            raise NotImplementedError(
                "AFD's attention role runs on vLLM's V1 model runner and this worker was "
                "configured for Model Runner V2; unset VLLM_USE_V2_MODEL_RUNNER"
            )
        with compat.seams().runner_class_swapped(_runner_cls):
            return super().init_device()

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(*args, **kwargs)
        except AfdStepFailed as exc:
            raise AfdStepFailed.reraise_short(exc) from None

    def execute_dummy_batch(self, *args: Any, **kwargs: Any) -> Any:
        """An idle DP rank's share of a serving step (vLLM runs a dummy batch so the DP ranks
        stay in step); its waits keep the normal step bound."""
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, AfdAttentionRunnerMixin):
            runner._afd_serving_dummy = True
        try:
            return super().execute_dummy_batch(*args, **kwargs)
        except AfdStepFailed as exc:
            raise AfdStepFailed.reraise_short(exc) from None
        finally:
            if isinstance(runner, AfdAttentionRunnerMixin):
                runner._afd_serving_dummy = False

    def afd_stats(self) -> dict[str, float]:
        """This rank's exchange split; `LLM.collective_rpc("afd_stats")` gathers it."""
        runner = getattr(self, "model_runner", None)
        session = getattr(runner, "_afd_session", None)
        return session.stats() if session is not None else {}

    def afd_drained(self) -> bool:
        """The API process has no request left and takes no new one while a planned change
        leaves this server out (`AsyncLLM.collective_rpc("afd_drained")`,
        vllm_ext.attention.leaving): tells afd-ctl. False when it is not leaving."""
        runner = getattr(self, "model_runner", None)
        session = getattr(runner, "_afd_session", None)
        return session.say_drained() if session is not None else False

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
