"""The attention worker's step state machine: one AFD step from its padding decision to its end.

`open_step` (as soon as vLLM has decided the step's padding) sizes the data plane for the step's
token counts, then (on a designated sender) publishes the AFDControlPayload; the model forward
checks it runs that step (`check_forward`); each proxy layer calls `exchange`; then `end_step`
(after each micro-batch's forward under dual-batch overlap; `finish_forward` after vLLM's model
call ends a step that ran as a replayed FULL CUDA graph, which runs no forward hooks). The
session (vllm_ext.attention.session) owns the link to afd-ctl and the data plane this uses.
Every wait is bounded by `step_timeout_s` and fails with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from afd_ctl.payloads import make_payload
from vllm_ext.attention.step_failures import AfdStepFailed, failing_step
from vllm_ext.exchange.nixl import StepShape

if TYPE_CHECKING:
    from vllm_ext.attention.session import AttentionSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepFlags:
    is_warmup: bool = False
    is_profile: bool = False
    is_graph_capturing: bool = False
    is_graph_replaying: bool = False

    def replaying(self) -> StepFlags:
        return dataclasses.replace(self, is_graph_replaying=True)

    @property
    def warmup(self) -> bool:
        """Compile or capture may run inside this step: waits get afd warmup_timeout_s."""
        return self.is_warmup or self.is_profile or self.is_graph_capturing


class AttentionSteps:
    """The open step of one attention worker and the count of its steps."""

    def __init__(self, session: AttentionSession) -> None:
        self.session = session
        self.step_id = 0
        # The open step captures CUDA graphs: the graph pieces before each exchange were only
        # recorded, not run, so their outputs are uninitialised memory; zeros go out instead.
        self._capturing = False
        # Steps published per CUDA-graph flag (logged at close as "afd attention flags").
        self.flag_counts = {"capture_steps": 0, "replay_steps": 0, "eager_steps": 0}
        self._capture_keys: set[tuple[int, ...]] = set()
        # The open step: its shape, this rank's rows per stage (micro-batch), how many layers
        # each stage exchanged, and how many stage forwards have not ended yet.
        self._shape: StepShape | None = None
        self._stage_rows: list[int] = []
        self._layers_done: list[int] = []
        self._forwards_left = 0
        # An AFD failure inside a micro-batch's thread (vLLM's dual-batch overlap does not
        # carry a thread's exception out): raised on the runner's own thread after the forward.
        self._stage_failure: BaseException | None = None
        # The open step is a FULL-graph capture: its exchanges are recorded, not run.
        self._recorded = False
        # (stage, hand-over) of the running micro-batch; vLLM's ubatching through compat.
        self.micro_batch: Callable[[], tuple[int, Callable[[], None]]] = _micro_batch

    def open_step(
        self,
        num_tokens: int,
        across_dp: list[int] | None,
        flags: StepFlags,
        stage_tokens: list[int] | None = None,
        full_graph: bool = False,
    ) -> None:
        """Opens a step as soon as its token counts are known: sizes the data plane, then (on a
        designated sender) publishes the AFDControlPayload. The runner calls it right after
        vLLM decided the step's padding, so the control hop overlaps with input preparation and
        the first attention layer instead of delaying the FFN side.

        `num_tokens`: rows this rank's model runs (padded); `across_dp`: every DP rank's.
        `stage_tokens`: under dual-batch overlap, each micro-batch's rows (padded); vLLM pads
        micro-batches alike on every DP rank, so every rank's count per stage is the same.
        Raises AfdStepFailed when the FFN side cannot serve this step (lost, not yet back):
        the engine fails the step's requests and stays up (vllm_ext.attention.step_failures).

        `full_graph`: vLLM runs this step as a FULL CUDA graph. Capturing one records the
        GPU-driven exchange without running it: such a step is published `records_only`, so
        the FFN side captures its graph for the same token counts and runs nothing either."""
        if self.session.data_plane is None or self.session.client is None:
            raise RuntimeError("afd: attention session is closed")
        if self._shape is not None:
            self._finish_abandoned_step()
        counts = self._counts(num_tokens, across_dp)
        stage_rows = list(stage_tokens) if stage_tokens else [num_tokens]
        if len(stage_rows) > 2:
            raise RuntimeError(
                f"afd: {len(stage_rows)} micro-batches in one step; the data plane carries 2"
            )
        stages = (
            {s: [rows] * len(counts) for s, rows in enumerate(stage_rows)}
            if stage_tokens
            else {0: counts}
        )
        self.step_id += 1
        shape = StepShape(step_id=self.step_id, stages=stages, warmup=flags.warmup)
        with failing_step(
            self.step_id, recoverable=self.session.tp_size == 1, on_failure=self.session.failed
        ):
            self.session.ensure_connected()
            # Data-plane state first (buffers for this step), then the control message; the
            # step counts as open (see _finish_abandoned_step) only once it is published.
            self.session.data_plane.begin_step(shape)
            self._recorded = full_graph and flags.is_graph_capturing
            if self._recorded and self.session.data_plane.path != "gpu":
                raise RuntimeError(
                    "afd: vLLM captures a FULL CUDA graph but the exchange is host-driven "
                    "(NIXL): it would be captured once and never run; vllm_ext bug"
                )
            if self.session.is_sender:
                payload = make_payload(
                    self.step_id,
                    shape.stages,
                    is_warmup=flags.is_warmup,
                    is_profile=flags.is_profile,
                    is_graph_capturing=flags.is_graph_capturing,
                    is_graph_replaying=flags.is_graph_replaying,
                    records_only=self._recorded,
                )
                self.session.client.publish(payload)
            self._shape, self._stage_rows = shape, stage_rows
            self._layers_done = [0] * len(stage_rows)
            self._forwards_left = len(stage_rows)
            self._stage_failure = None
            self._capturing = flags.is_graph_capturing
            self._count_flags(flags, counts, recorded=self._recorded)
        if self.session.profiler is not None:
            self.session.profiler.step(self.step_id)

    def _count_flags(self, flags: StepFlags, counts: list[int], recorded: bool = False) -> None:
        """Steps published per flag: the FFN side must capture and replay exactly these. A
        FULL-graph capture is not published (it runs nothing): counted apart."""
        if recorded:
            self.flag_counts["full_graph_captures"] = (
                self.flag_counts.get("full_graph_captures", 0) + 1
            )
        elif flags.is_graph_capturing:
            self.flag_counts["capture_steps"] += 1
            self._capture_keys.add(tuple(counts))
        elif flags.is_graph_replaying:
            self.flag_counts["replay_steps"] += 1
        else:
            self.flag_counts["eager_steps"] += 1
        self.flag_counts["capture_keys"] = len(self._capture_keys)

    def check_forward(self, num_tokens: int) -> None:
        """At the model forward (each micro-batch's, under dual-batch overlap): the open step
        must be for exactly these rows."""
        if self._shape is None:
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
        """A step was published but its forward did not run every layer (it raised): the FFN
        side waits for the rest, so send zeros for the remaining layers of every stage, in the
        order the FFN side takes them (layer by layer, stage 0 first), and drop the outputs."""
        assert self._shape is not None and self.session.data_plane is not None
        step_id = self._shape.step_id
        log.warning(
            "afd attention %s: step %d ended after %s of %d layers per stage; completing it "
            "with zeros",
            self.session.worker_id,
            step_id,
            self._layers_done,
            self.session.num_layers,
        )
        device = (
            self.session.data_plane.transport.device
            if self.session.data_plane.path == "gpu"
            else "cpu"
        )
        zeros = [
            torch.zeros(rows, self.session.hidden_size, dtype=self.session.dtype, device=device)
            for rows in self._stage_rows
        ]
        try:
            with failing_step(step_id):
                if self.session.data_plane.path == "gpu":
                    self._shape = None
                    if self._recorded:
                        return
                    for layer in range(min(self._layers_done), self.session.num_layers):
                        for stage, done in enumerate(self._layers_done):
                            if done <= layer:
                                out = torch.empty_like(zeros[stage])
                                self.session.data_plane.exchange_into(
                                    layer, stage, zeros[stage], None, out
                                )
                    self.session.data_plane.end_step_gpu()
                    return
                for layer in range(min(self._layers_done), self.session.num_layers):
                    todo = [s for s, done in enumerate(self._layers_done) if done <= layer]
                    for stage in todo:
                        self.session.data_plane.send(layer, stage, zeros[stage])
                    for stage in todo:
                        self.session.data_plane.recv(layer, stage, zeros[stage])
                self.session.data_plane.end_step()
        except AfdStepFailed as exc:  # the next step reconnects if the FFN side is gone
            log.warning("afd attention %s: %s", self.session.worker_id, exc)
        self._shape = None

    def _counts(self, num_tokens: int, across_dp: list[int] | None) -> list[int]:
        if self.session.dp_size == 1:
            return [num_tokens]
        if across_dp is None or len(across_dp) != self.session.dp_size:
            raise RuntimeError(
                f"afd: attention DP {self.session.dp_size} but vLLM gave no per-rank token counts "
                f"({across_dp!r}); cannot tell the FFN side the token counts"
            )
        if across_dp[self.session.dp_rank] != num_tokens:
            raise RuntimeError(
                f"afd: DP rank {self.session.dp_rank} runs {num_tokens} rows but vLLM's per-rank "
                f"counts say {across_dp}"
            )
        return across_dp

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
        it yields back, then the output is taken. On the GPU path the round trip is only
        enqueued on the stream (or captured into vLLM's FULL graph); end_step waits for it."""
        exchange, shape = self.session.data_plane, self._shape
        if exchange is None or shape is None:
            raise RuntimeError("afd: FFN exchange outside a step")
        if output is None:
            output = torch.empty_like(hidden_states)
        if self._capturing and not torch.cuda.is_current_stream_capturing():
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
            with failing_step(
                shape.step_id,
                layer_idx,
                recoverable=self.session.tp_size == 1,
                on_failure=self.session.failed,
            ):
                if exchange.path == "gpu":
                    exchange.exchange_into(layer_idx, stage, hidden_states, router_logits, output)
                    if overlapped:
                        handed_over = True
                        hand_over()
                    out = output
                elif not overlapped:
                    exchange.exchange_into(layer_idx, stage, hidden_states, router_logits, output)
                    out = output
                else:
                    exchange.send(layer_idx, stage, hidden_states, router_logits)
                    handed_over = True
                    hand_over()
                    out = output.copy_(exchange.recv(layer_idx, stage, hidden_states))
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
        return out

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
        if self.session.data_plane is not None and self._shape is not None:
            shape, self._shape = self._shape, None
            with failing_step(
                shape.step_id, recoverable=self.session.tp_size == 1, on_failure=self.session.failed
            ):
                if self.session.data_plane.path == "gpu":
                    if not self._recorded:
                        self.session.data_plane.end_step_gpu()
                else:
                    self.session.data_plane.end_step()
            self.session.metrics.flush()
        self._shape = None

    def finish_forward(self) -> None:
        """After vLLM's model call returned (runner side): a step still open here ran as a
        replayed FULL CUDA graph, which runs no forward hooks; it ends now."""
        if self._shape is not None and self._stage_failure is None:
            self._forwards_left = 1
            self.end_step()


def _micro_batch() -> tuple[int, Callable[[], None]]:
    from vllm_ext import compat

    return compat.seams().micro_batch()
