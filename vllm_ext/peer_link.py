"""How one vLLM worker (an attention rank or an FFN server) links up with its peers, the same
way on both sides: ask afd-ctl how many ranks of each role it expects (`expected_counts`, a
control-plane query in `vllm_ext.control`, which sizes the data plane), register, and
(re)connect the data plane to each newer complete view.

Each side still decides *when* to reconnect (the attention side before a step, the FFN server
when a payload or a loss says so); this module is the *how* that both share.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from afd_ctl.fingerprint import ModelFingerprint
from vllm_ext.control import ExpectedCounts, expected_counts
from vllm_ext.exchange.base import AttentionExchange, FfnExchange
from vllm_ext.exchange.timing import ExchangeTimings
from vllm_ext.weights_digest import model_weights_digest

if TYPE_CHECKING:
    from afd_ctl.client import ControllerClient, WorkerSpec
    from afd_ctl.v1 import afd_pb2
    from afd_data.rendezvous import StuckLossWatch
    from vllm_ext.control import ControlAccess
    from vllm_ext.exchange.factory import Exchanges

__all__ = ["ExpectedCounts", "PeerLink", "elastic_spec", "expected_counts", "model_fingerprint"]
E = TypeVar("E", AttentionExchange, FfnExchange)


def model_fingerprint(vllm_config: Any) -> ModelFingerprint:
    """What this worker serves, from vLLM's model config: the same on both roles of one model
    (the attention role's registered "Afd..." architecture is named as the checkpoint's)."""
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    architecture = (getattr(hf, "architectures", None) or [""])[0]
    routed = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", None) or 0
    return ModelFingerprint(
        architecture=architecture.removeprefix("Afd"),
        num_layers=int(getattr(hf, "num_hidden_layers", 0) or 0),
        hidden_size=int(getattr(hf, "hidden_size", 0) or 0),
        num_routed_experts=int(routed),
        num_shared_experts=int(getattr(hf, "n_shared_experts", None) or 0),
        dtype=str(model_config.dtype).removeprefix("torch."),
        weights_digest=model_weights_digest(vllm_config),
    )


def elastic_spec(spec: WorkerSpec, plane: Any, elastic: bool) -> WorkerSpec:
    """`spec` with what afd-ctl checks an `afd-ctl scale` target against (issue 37): the
    ranks the data plane was sized for, and whether this worker follows planned changes (it
    does when sized for them: afd max_attention / max_ffn)."""
    most_attention, most_ffn = plane.max_counts
    return dataclasses.replace(
        spec, max_attention=most_attention, max_ffn=most_ffn, follows_scale=elastic
    )


class PeerLink(Generic[E]):
    """One worker's afd-ctl session wired to its data plane: every loss afd-ctl reports (or the
    loss of afd-ctl itself) interrupts the transport's waits, and a loss only the data plane
    saw makes the worker rejoin in a new epoch once it has lasted (StuckLossWatch).
    `exchange` is the implementation the last connect chose (vllm_ext.exchange.factory)."""

    def __init__(
        self,
        access: ControlAccess,
        spec: WorkerSpec,
        exchanges: Exchanges[E],
        who: str,
        vllm_config: Any = None,
    ) -> None:
        from afd_data.rendezvous import StuckLossWatch, follow_losses

        if vllm_config is not None and spec.model is None:
            # afd-ctl refuses a peer of another model at registration, naming both sides.
            spec = dataclasses.replace(spec, model=model_fingerprint(vllm_config))
        self.exchanges: Exchanges[E] = exchanges
        self.plane = exchanges.plane
        self.client: ControllerClient = access.client(spec, self.plane.blob())
        # Per-step timings to afd-ctl (issue 26): `afd-ctl status`, `advise`, `trace`.
        exchanges.reporting.timings = ExchangeTimings(self.client.timings)
        self.client.timings.layers = spec.model.num_layers if spec.model is not None else 0
        transport = self.plane.transport
        follow_losses(self.client, transport)
        self.loss_watch: StuckLossWatch = StuckLossWatch(self.client, transport, who)
        self.exchange: E | None = None  # set by connect

    def register(self, timeout_s: float) -> afd_pb2.Registered:
        """Registers with afd-ctl (retrying while it is unreachable), bounded."""
        return self.client.connect(timeout_s=timeout_s)

    @property
    def transport_epoch(self) -> int:
        return self.plane.epoch

    def in_step(self) -> bool:
        """The data plane is whole and at afd-ctl's current complete epoch."""
        transport, view = self.plane.transport, self.client.view
        return transport.lost is None and view.complete and view.epoch == transport.epoch

    def wait_newer(self, timeout_s: float, after_epoch: int | None = None) -> afd_pb2.View:
        """The next complete view newer than `after_epoch` (default: the data plane's)."""
        after = self.transport_epoch if after_epoch is None else after_epoch
        return self.client.wait_complete(timeout_s=timeout_s, after_epoch=after)

    def connect(self, view: Any) -> E:
        """Connects the data plane to `view`'s peers (the path may change) and returns the
        exchange to run; a later loss starts its own clock."""
        self.exchange = self.exchanges.connect(view)
        self.loss_watch.reset()
        return self.exchange

    def close(self, reason: str) -> None:
        """Leaves afd-ctl saying why (every peer's PEER_LOST says "left: <reason>")."""
        self.client.close(reason=reason)
