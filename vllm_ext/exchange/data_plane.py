"""One worker's data plane, whichever path it runs: the NIXL transport (rendezvous, membership,
epochs; always connected) and, where its buffer is CUDA memory, the GPU-driven hop beside it.

At every connect the hop chooses the path to the view's peers (afd_data.gpu_protocol: peers on
this host with exportable CUDA buffers run the GPU-driven exchange, others NIXL) and the worker
logs which (`afd data path: ...`). The exchange implementations (vllm_ext.exchange.nixl,
vllm_ext.exchange.gpu) drive this plane; vllm_ext.exchange.factory picks one per path.

The transports are sized from M and N (attention and FFN ranks) and the FFN groups of the
routing before registering, because the rendezvous blob describes the buffers:
`vllm_ext.control.expected_counts` asks the daemon.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from afd_ctl.routing import Role
from afd_ctl.step import Step
from afd_data import NixlTransport, TransportConfig
from afd_data.errors import AfdBadInput, AfdPeerLost, AfdStaleEpoch
from afd_data.gpu_protocol import NIXL, PathChoice

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


def as_tensor(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy torch view of a transport buffer (numpy on CPU, torch on CUDA)."""
    if isinstance(array, torch.Tensor):
        return array
    t = torch.from_numpy(array)
    return t.view(dtype) if t.dtype != dtype else t


def _device() -> str:
    """Where the worker's model runs: its buffers live there (VRAM of the worker's current
    CUDA device on GPU, so NIXL writes GPU to GPU; host DRAM on CPU)."""
    from vllm_ext import compat

    if compat.seams().on_cpu():
        return "cpu"
    return f"cuda:{torch.cuda.current_device()}"


class DataPlane:
    def __init__(
        self,
        role: Role,
        *,
        name: str,
        rank: int,
        dtype: torch.dtype,
        router: tuple[int, str],
        timeout_s: float,
        warmup_timeout_s: float | None = None,
        hidden_size: int,
        max_tokens: int,
        num_attention: int,
        num_ffn: int,
        ffn_groups: int | None = None,
        num_stages: int | None = None,
        num_layers: int = 0,
        device: str | None = None,
        capacity: tuple[int, int] = (0, 0),
    ) -> None:
        self.role = role
        self.dtype = dtype
        self.router_dtype = torch_dtype(router[1])
        self.timeout_s = timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        # AFD_DATA_<FIELD> environment variables tune the rest (polling, bounds, progress).
        config = TransportConfig.from_env(
            hidden_size=hidden_size,
            max_tokens_per_peer=max_tokens,
            dtype=str(dtype),
            num_attention=num_attention,
            num_ffn=num_ffn,
            ffn_groups=ffn_groups,  # afd-ctl's (vllm_ext.control.expected_counts)
            recv_timeout_s=timeout_s,
            router_width=router[0],
            router_dtype=router[1],
            num_stages=num_stages,
            num_layers=num_layers,  # the GPU hop's flags follow them (gpu_protocol.flag_use)
            # Issue 37, `capacity` (max attention, max FFN ranks): sized for the largest
            # membership `afd-ctl scale` may move to (0, 0: exactly num_attention:num_ffn);
            # each connect then takes the view's routing.
            max_attention=capacity[0] or None,
            max_ffn=capacity[1] or None,
        )
        self.transport = NixlTransport(
            f"afd-{name}-{time.time_ns()}", role, rank, config, device=device or _device()
        )
        self.device: str = self.transport.device
        self.hop: Any = None  # afd_data.gpu_hop.GpuHop where the buffer is CUDA memory
        if self.device != "cpu":
            from afd_data.gpu_hop import GpuHop

            t = self.transport
            self.hop = GpuHop(role, rank, config, t.layout, t.local)
        self.choice = PathChoice(NIXL, "not connected")

    @property
    def path(self) -> str:
        """The exchange path the last connect chose (afd_data.gpu_protocol's GPU or NIXL)."""
        return self.choice.path

    @property
    def config(self) -> TransportConfig:
        """The transport's config: its routing is the last connect's (issue 37)."""
        return self.transport.config

    @property
    def max_counts(self) -> tuple[int, int]:
        """(attention, FFN) ranks the buffers are sized for (what a worker registers)."""
        config = self.transport.config
        if config.elastic:
            return config.max_attention, config.max_ffn
        return config.num_attention, config.num_ffn

    @property
    def epoch(self) -> int:
        return self.transport.epoch or 0

    @property
    def rank(self) -> int:
        return self.transport.role_rank

    def blob(self) -> bytes:
        return self.transport.blob()

    def bound_s(self, step: Step) -> float:
        """Each wait's bound in `step`: warm-up, profile and capture steps (compile and graph
        capture may run inside them) get the warm-up bound."""
        if step.warmup and self.warmup_timeout_s is not None:
            return self.warmup_timeout_s
        return self.timeout_s

    def lost_reason(self) -> str | None:
        lost = self.transport.lost
        return None if lost is None else str(lost).removeprefix("afd peer lost: ")

    def check_step(self, step: Step) -> None:
        """A step may run on this plane: no loss, and (FFN side) the payload's epoch is the
        plane's (the GPU-driven path's check; NIXL's begin_step makes its own)."""
        lost = self.transport.lost
        if lost is not None:
            raise lost
        if step.epoch is not None and step.epoch != self.epoch:
            raise AfdStaleEpoch(
                f"step {step.step_id} is of epoch {step.epoch}, the data plane of epoch "
                f"{self.epoch}"
            )

    def mark_lost(self, why: str) -> None:
        """A step the GPU-driven path had to release is a loss the transport keeps (every step
        fails at once until a reconnect; a loss only this data plane saw makes the worker
        rejoin)."""
        if self.transport.lost is None:
            for rank in self.transport.peer_ranks[:1]:
                self.transport.mark_peer_lost(self.role.other, rank, why)

    def connect(self, view: Any) -> PathChoice:
        """Connects to the view's peers and chooses the path to them (the caller drained the
        exchange of the previous connect first). A shape mismatch names the vLLM/AFD settings
        behind it."""
        from afd_data.rendezvous import peers_from_view, routing_of

        try:
            self.transport.reconnect(view.epoch, peers_from_view(view), routing_of(view))
        except AfdBadInput as exc:
            if "buffer shape differs" not in str(exc):
                raise
            raise AfdBadInput(
                f"{exc}. With vLLM these follow from settings both roles must share: --dtype, "
                "the model (hidden size, experts), afd max_tokens (or --max-num-batched-tokens), "
                "and afd gate"
            ) from None
        peers = self.transport.peer_blobs()
        if self.hop is None:
            self.choice = PathChoice(NIXL, "this worker's buffer is host memory")
        else:
            self.hop.config = self.transport.config  # the view's routing (issue 37)
            bound = self.warmup_timeout_s or self.timeout_s
            try:
                self.choice = self.hop.connect(view.epoch, peers, bound, self._idle)
            except Exception as exc:
                # The transport is at the new epoch but the flags were not zeroed (a peer did
                # not mark its stream drained): no step may run on them, so this is a loss.
                self.mark_lost(f"the GPU hop could not connect at epoch {view.epoch}: {exc}")
                raise
        log.info(
            "afd data path: %s rank %d uses the %s exchange to its %d peer(s) at epoch %d (%s)",
            self.role.label,
            self.rank,
            self.choice.label,
            len(peers),
            view.epoch,
            self.choice.reason,
        )
        return self.choice

    def _idle(self) -> None:
        """While the hop's connect waits for the peers' drained marks: NIXL progresses, and a
        peer lost meanwhile (it failed to map this buffer and left) ends the wait at once."""
        self.transport.poll_idle()
        lost = self.transport.lost
        if lost is not None:
            raise lost

    def poll_idle(self) -> None:
        self.transport.poll_idle()

    def close(self) -> None:
        try:
            if self.hop is not None:
                self.hop.close()
        finally:
            self.transport.close()


__all__ = ["AfdPeerLost", "DataPlane", "as_tensor", "torch_dtype"]
