"""The exchange each role's step code talks to, whichever path runs it.

Two implementations of each protocol: the host-driven NIXL exchange (vllm_ext.exchange.nixl;
peers on other hosts, or host memory) and the GPU-driven one (vllm_ext.exchange.gpu; peers on
this host: the GPUs run the hop themselves, inside CUDA graphs). `vllm_ext.exchange.factory`
builds the one the data plane chose at connect, and is the only place the path is compared; a
reconnect may switch it. Callers never branch on the path: what differs (when the host waits,
how the FFN side launches a step, what a failed step's verdict costs) is inside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from afd_ctl.step import Step


@dataclass(frozen=True)
class StepSplit:
    """Where an FFN step's host time went, seconds: waiting for rows, computing (on the
    GPU-driven path: enqueueing), sending the outputs back."""

    recv_s: float = 0.0
    compute_s: float = 0.0
    send_s: float = 0.0


class AttentionExchange(Protocol):
    """An attention worker's exchange. Per step: `begin_step` (before the payload is
    published), `published` (after it), per layer and micro-batch `post` then `take` (under dual-batch overlap with a
    hand-over to the other micro-batch between them), `end_step` after the forward.
    `settle` is the verdict of closed steps, asked where vLLM first reads what they produced."""

    path: str  # afd_data.gpu_protocol's GPU or NIXL, for reports and logs
    device: str  # where rows for `post` may live ("cpu" or "cuda:N")
    # FULL CUDA graphs can hold it (its layers only enqueue GPU work): vLLM keeps the CUDA graph
    # mode asked for; else FULL modes become PIECEWISE (vllm_ext.hooks).
    full_graphs: bool

    def begin_step(self, step: Step) -> None: ...

    def published(self) -> None:
        """The step's payload was just published: a stamp for the step's timeline, and the
        place for bookkeeping that must not delay the payload."""

    def post(
        self, layer: int, stage: int, hidden: torch.Tensor, router: torch.Tensor | None
    ) -> None:
        """The send half of one layer's round trip: `hidden` (rows, hidden_size) out."""

    def take(self, layer: int, stage: int, out: torch.Tensor) -> None:
        """The receive half: the FFN peers' outputs of what `post` sent, summed into `out`."""

    def end_step(self) -> None:
        """After the step's forward was run (or enqueued): the step is closed."""

    def settle(self, step_ids: Sequence[int]) -> None:
        """Raises AfdPeerLost or AfdTimeout if one of these closed steps failed (its outputs
        must not be used)."""

    def raise_failure(self) -> None:
        """Before a step: raises (once) the failure of steps still in flight, so the next step
        fails at once with them instead of waiting for afd-ctl's next view."""

    def drain(self, reason: str) -> None:
        """Before a reconnect or close: nothing of this side is left in flight."""

    def connected(self) -> None:
        """After a (re)connect to new peers."""

    def close(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


class FfnExchange(Protocol):
    """An FFN worker's exchange: `run_step` serves one step (every layer and stage)."""

    path: str

    def run_step(self, step: Step, received_at: float = 0.0) -> StepSplit:
        """`received_at`: when the step's payload was taken (monotonic), for its timeline."""

    def check(self) -> None:
        """Between payloads: raises AfdPeerLost once a step in flight failed (a peer lost, or
        past its bound); nothing on the host-driven path, whose steps end before run_step
        returns."""

    def drain(self, reason: str) -> None: ...

    def connected(self) -> None:
        """After a (re)connect to new peers."""

    def close(self) -> None: ...

    def stats(self) -> dict[str, float]: ...
