"""The attention worker's step state machine: one AFD step from its padding decision to its
verdict.

`open_step` (as soon as vLLM has decided the step's padding) asks its link for the exchange to
run (reconnecting first when needed), begins the step there, then (on a designated sender)
publishes the AFDControlPayload; the model forward checks it runs that step (`check_forward`);
each proxy layer calls `exchange`; then `end_step` (after each micro-batch's forward under
dual-batch overlap; `finish_forward` after vLLM's model call ends a step that ran as a replayed
FULL CUDA graph, which runs no forward hooks). `take_verdict` hands vLLM the check of the steps
closed since the last one, run where it first reads their sampled tokens (a GPU-driven step is
only enqueued when it closes). Every wait is bounded and fails with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from afd_ctl.step import Step, StepFlags
from vllm_ext.attention.abandoned import complete_abandoned
from vllm_ext.attention.flag_counts import FlagCounts
from vllm_ext.attention.host_time import HostTime
from vllm_ext.attention.step_failures import failing_step
from vllm_ext.attention.verdicts import Verdict, Verdicts
from vllm_ext.exchange.base import AttentionExchange

log = logging.getLogger(__name__)


class StepLink(Protocol):
    """What the step machine needs of its worker's session."""

    def exchange_for_step(self) -> AttentionExchange:
        """The exchange to run the next step on, reconnected first when the data plane lost a
        peer or afd-ctl moved on; raises AfdNotReady when there is no FFN side to run on."""

    def across_attention(self, server_counts: list[int]) -> list[int]:
        """Counts per routed attention rank from this server's (vllm_ext.attention.place)."""

    def publish(self, step: Step) -> None:
        """Publishes the step's payload (a designated sender only; others do nothing)."""

    def failed(self, exc: BaseException) -> None:
        """A step failed with `exc` (counted by reason)."""

    def step_opened(self, step_id: int) -> None: ...

    def step_closed(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class RankShape:
    """What the step machine needs to know of its rank and model."""

    worker_id: str
    dp_rank: int
    dp_size: int
    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    # A failed step fails its requests (attention TP 1); else it ends the server.
    recoverable: bool = True


class Steps(Protocol):
    """The step calls vLLM's runner makes (AttentionSteps on an exchanging rank,
    vllm_ext.attention.tp_group.FollowerSteps on a TP follower)."""

    @property
    def flag_counts(self) -> Mapping[str, int]: ...

    host_time: HostTime  # AFD's own time on the runner's thread (empty on a TP follower)

    def open_step(
        self,
        num_tokens: int,
        across_dp: list[int] | None,
        flags: StepFlags,
        stage_tokens: list[int] | None = None,
        full_graph: bool = False,
    ) -> None: ...

    def check_forward(self, num_tokens: int) -> None: ...

    def end_step(self) -> None: ...

    def finish_forward(self) -> None: ...

    def raise_stage_failure(self) -> None: ...

    def take_verdict(self) -> Verdict: ...

    def settle_now(self) -> None: ...


class AttentionSteps:
    """The open step of one attention worker and the count of its steps."""

    def __init__(self, link: StepLink, rank: RankShape) -> None:
        self.link = link
        self.rank = rank
        self.step_id = 0
        # Steps published per CUDA-graph flag (logged at close as "afd attention flags").
        self.flag_counts = FlagCounts()
        self.host_time = HostTime()  # AFD's own time on the runner's thread per step
        # The open step, the exchange it runs on, this rank's rows per stage (micro-batch), how
        # many layers each stage exchanged, and how many stage forwards have not ended yet.
        self._step: Step | None = None
        self._exchange: AttentionExchange | None = None
        self._stage_rows: list[int] = []
        self._layers_done: list[int] = []
        self._forwards_left = 0
        # An AFD failure inside a micro-batch's thread (vLLM's dual-batch overlap does not
        # carry a thread's exception out): raised on the runner's own thread after the forward.
        self._stage_failure: BaseException | None = None
        self.verdicts = Verdicts(self._failing)
        # (stage, hand-over) of the running micro-batch; vLLM's ubatching through compat.
        self.micro_batch: Callable[[], tuple[int, Callable[[], None]]] = _micro_batch

    def next_step_id(self) -> int:
        self.step_id += 1
        return self.step_id

    def open_step(
        self,
        num_tokens: int,
        across_dp: list[int] | None,
        flags: StepFlags,
        stage_tokens: list[int] | None = None,
        full_graph: bool = False,
    ) -> None:
        """Opens a step as soon as its token counts are known: begins it on the exchange, then
        (on a designated sender) publishes the AFDControlPayload. The runner calls it right
        after vLLM decided the step's padding, so the control hop overlaps with input
        preparation and the first attention layer instead of delaying the FFN side.

        `num_tokens`: rows this rank's model runs (padded); `across_dp`: every DP rank's.
        `stage_tokens`: under dual-batch overlap, each micro-batch's rows (padded); vLLM pads
        micro-batches alike on every DP rank, so every rank's count per stage is the same.
        Raises AfdStepFailed when the FFN side cannot serve this step (lost, not yet back):
        the engine fails the step's requests and stays up (step_failures).

        `full_graph`: vLLM runs this step as a FULL CUDA graph. Capturing one records the
        GPU-driven exchange without running it: such a step is published `records_only`, so
        the FFN side captures its graph for the same token counts and runs nothing either."""
        self.host_time.cpu_from()
        opened = self.host_time.start()
        if self._step is not None:
            self._finish_abandoned_step()
        stage_rows = list(stage_tokens) if stage_tokens else [num_tokens]
        if len(stage_rows) > 2:
            raise RuntimeError(
                f"afd: {len(stage_rows)} micro-batches in one step; the data plane carries 2"
            )
        if full_graph and flags.is_graph_capturing:
            flags = dataclasses.replace(flags, records_only=True)
        step_id = self.next_step_id()
        with self._failing(step_id):
            # Reconnected first (a loss, a planned change): counts of the step's epoch.
            connecting = self.host_time.start()
            exchange = self.link.exchange_for_step()
            self.host_time.add("connect", connecting)
            counts = self._counts(num_tokens, across_dp)
            per_stage = [[rows] * len(counts) for rows in stage_rows] if stage_tokens else [counts]
            step = Step.of(step_id, per_stage, flags=flags)
            if step.flags.records_only and not exchange.full_graphs:
                raise RuntimeError(
                    "afd: vLLM captures a FULL CUDA graph but the exchange is host-driven "
                    "(NIXL): it would be captured once and never run; vllm_ext bug"
                )
            # Data-plane state first (buffers for this step), then the control message; the
            # step counts as open (see _finish_abandoned_step) only once it is published.
            begun = self.host_time.start()
            exchange.begin_step(step)
            published = self.host_time.add("begin", begun)
            self.link.publish(step)
            retiring = self.host_time.add("publish", published)
            exchange.published()
            self.host_time.add("retired", retiring)
            self._step, self._exchange, self._stage_rows = step, exchange, stage_rows
            self._layers_done = [0] * len(stage_rows)
            self._forwards_left = len(stage_rows)
            self._stage_failure = None
            self.flag_counts.count(step.flags, counts)
        self.link.step_opened(step.step_id)
        self.host_time.add("open", opened)
        self.host_time.cpu_to()

    def _failing(
        self, step_id: int, layer: int | None = None
    ) -> contextlib.AbstractContextManager[None]:
        return failing_step(
            step_id, layer, recoverable=self.rank.recoverable, on_failure=self._failed
        )

    def _failed(self, exc: BaseException) -> None:
        self.verdicts.clear()  # the engine fails every running request
        self.link.failed(exc)

    def check_forward(self, num_tokens: int) -> None:
        """At the model forward (each micro-batch's, under dual-batch overlap): the open step
        must be for exactly these rows."""
        if self._step is None:
            raise RuntimeError(
                "afd: a model forward without an open AFD step (vLLM ran the model without "
                "deciding its batch padding first); vllm_ext needs updating for this vLLM"
            )
        stage, _ = self.micro_batch()
        expected = self._stage_rows[stage] if stage < len(self._stage_rows) else None
        if num_tokens != expected:
            raise RuntimeError(
                f"afd: step {self.step_id}: micro-batch {stage} runs {num_tokens} rows but the "
                f"step was published for {self._stage_rows}; vllm_ext needs updating for this "
                "vLLM"
            )

    def _finish_abandoned_step(self) -> None:
        step, exchange = self._step, self._exchange
        assert step is not None and exchange is not None
        self._step = None
        complete_abandoned(step, exchange, self._stage_rows, self._layers_done, self.rank)

    def _counts(self, num_tokens: int, across_dp: list[int] | None) -> list[int]:
        dp_rank, dp_size = self.rank.dp_rank, self.rank.dp_size
        if dp_size == 1:
            return self.link.across_attention([num_tokens])
        if across_dp is None or len(across_dp) != dp_size:
            raise RuntimeError(
                f"afd: attention DP {dp_size} but vLLM gave no per-rank token counts "
                f"({across_dp!r}); cannot tell the FFN side the token counts"
            )
        if across_dp[dp_rank] != num_tokens:
            raise RuntimeError(
                f"afd: DP rank {dp_rank} runs {num_tokens} rows but vLLM's per-rank counts say "
                f"{across_dp}"
            )
        return self.link.across_attention(across_dp)

    def exchange(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's FFN round trip for the running micro-batch, into `output` (allocated
        when None) and returned. Under dual-batch overlap the rows go out, the other
        micro-batch runs (its attention computes while the FFN side computes these rows) until
        it yields back, then the output is taken. On the GPU-driven path both halves are only
        enqueued on the stream (or captured into vLLM's FULL graph)."""
        exchange, step = self._exchange, self._step
        if exchange is None or step is None:
            raise RuntimeError("afd: FFN exchange outside a step")
        if output is None:
            output = torch.empty_like(hidden_states)
        if step.flags.is_graph_capturing and not torch.cuda.is_current_stream_capturing():
            # Piecewise capture: the pieces before this op were recorded, not run.
            hidden_states = torch.zeros_like(hidden_states)
            router_logits = None if router_logits is None else torch.zeros_like(router_logits)
        stage, hand_over = self.micro_batch()
        overlapped = len(self._stage_rows) > 1
        if overlapped and self._stage_failure is not None:
            hand_over()  # the step failed in a micro-batch: keep the hand-overs paired
            return output.zero_()
        handed_over = False
        try:
            with self._failing(step.step_id, layer_idx):
                if overlapped:
                    exchange.post(layer_idx, stage, hidden_states, router_logits)
                    handed_over = True
                    hand_over()
                    exchange.take(layer_idx, stage, output)
                else:
                    exchange.post(layer_idx, stage, hidden_states, router_logits)
                    exchange.take(layer_idx, stage, output)
        except Exception as exc:
            if not overlapped:
                raise
            # A micro-batch's thread cannot fail the step itself (vLLM does not carry its
            # exception out): the runner raises it after the forward (raise_stage_failure).
            # Zeros let this micro-batch finish so the other one is not left waiting.
            self._stage_failure = exc
            if not handed_over:
                hand_over()
            return output.zero_()
        self._layers_done[stage] = layer_idx + 1
        return output

    def raise_stage_failure(self) -> None:
        """On the runner's thread after the model forward: a micro-batch's failure fails the
        step here (see exchange)."""
        failure, self._stage_failure = self._stage_failure, None
        if failure is not None:
            raise failure

    def end_step(self) -> None:
        """After the model forward; under dual-batch overlap after each micro-batch's, and the
        step ends with the last."""
        self._forwards_left -= 1
        if self._forwards_left > 0:
            return
        if self._stage_failure is not None:
            return  # the step is abandoned: the next open_step completes it
        step, exchange = self._step, self._exchange
        self._step = None
        if step is None or exchange is None:
            return
        self.host_time.cpu_from()
        closing = self.host_time.start()
        with self._failing(step.step_id):
            exchange.end_step()
        self.verdicts.closed(exchange, step.step_id)
        bookkeeping = self.host_time.add("enqueue", closing)
        self.link.step_closed()
        self.host_time.add("closed", bookkeeping)
        self.host_time.add("close", closing)
        self.host_time.cpu_to()
        self.host_time.step_done()

    def finish_forward(self) -> None:
        """After vLLM's model call returned (runner side): a step still open here ran as a
        replayed FULL CUDA graph, which runs no forward hooks; it ends now."""
        if self._step is not None and self._stage_failure is None:
            self._forwards_left = 1
            self.end_step()

    def take_verdict(self) -> Verdict:
        """The check of the steps closed since the last call, for vLLM to run where it first
        reads their sampled tokens (vllm_ext.attention.verdicts)."""
        return self.verdicts.take()

    def settle_now(self) -> None:
        """Warm-up, profile and capture runs (and an idle DP rank's dummy batch), which no
        sampling follows: their verdict now."""
        self.take_verdict()()


def _micro_batch() -> tuple[int, Callable[[], None]]:
    from vllm_ext import compat

    return compat.seams().micro_batch()
