"""How one vLLM worker (an attention rank or an FFN server) links up with its peers, the same
way on both sides: ask afd-ctl how many ranks of each role it expects (`expected_counts`, a
control-plane query in `vllm_ext.control`, which sizes the data plane), register, and
(re)connect the data plane to each newer complete view.

Each side still decides *when* to reconnect (the attention side before a step, the FFN server
when a payload or a loss says so); this module is the *how* that both share.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from afd_ctl import direct
from afd_ctl.fingerprint import ModelFingerprint
from afd_ctl.routing import Role
from afd_ctl.step import Step
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

log = logging.getLogger(__name__)
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
        # Step payloads straight between the sender and its FFN workers on this host
        # (afd_ctl.direct): the attention side sends, the FFN side takes.
        self.sender: direct.DirectSender | None = None
        self.inbox: direct.DirectInbox | None = None
        self._direct: str = access.direct_payloads
        self._coalesce_s: float = access.publish_coalesce_s
        sock = _step_socket(who) if self._direct != "off" else None
        if sock is not None:
            spec = dataclasses.replace(spec, step_socket=sock.name)
            if Role.parse(spec.role) is Role.ATTENTION:
                self.sender = direct.DirectSender(sock)
            else:
                self.inbox = direct.DirectInbox(sock)
        self._sock: direct.StepSocket | None = sock
        self.exchanges: Exchanges[E] = exchanges
        self.plane = exchanges.plane
        self.client: ControllerClient = access.client(spec, self.plane.blob())
        if self.sender is not None:
            self.client.publisher.window = self._publish_window
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

    def newer_view_known(self) -> bool:
        """afd-ctl's current view is complete and newer than the data plane's epoch."""
        view = self.client.view
        return view is not None and view.complete and view.epoch > self.transport_epoch

    def wait_newer(self, timeout_s: float, after_epoch: int | None = None) -> afd_pb2.View:
        """The next complete view newer than `after_epoch` (default: the data plane's)."""
        after = self.transport_epoch if after_epoch is None else after_epoch
        return self.client.wait_complete(timeout_s=timeout_s, after_epoch=after)

    def connect(self, view: Any) -> E:
        """Connects the data plane to `view`'s peers (the path may change) and returns the
        exchange to run; a later loss starts its own clock."""
        self.exchange = self.exchanges.connect(view)
        self.loss_watch.reset()
        self._follow_direct(view)
        return self.exchange

    def _follow_direct(self, view: Any) -> None:
        """Who this worker sends step payloads to directly (an attention sender: its FFN
        subscribers), or takes them from (an FFN worker: its attention peers), in `view`."""
        use = self._direct == "on" or self.exchanges.gpu_driven  # "auto": the GPU-driven path
        if self.sender is not None:
            rank = self.client.role_rank
            targets = direct.subscriber_sockets(view, rank) if use else {}
            self.sender.connect(targets, len(direct.subscriber_ranks(view, rank)))
        if self.inbox is not None:
            self.inbox.allow(direct.peer_sockets(view) if use else [])

    def _publish_window(self) -> float:
        """How long afd-ctl's copy of a payload may wait for the next ones: while the
        GPU-driven exchange runs (its FFN side takes direct payloads) and every subscriber gets
        them directly, that copy is off the step's path (afd publish_coalesce_s)."""
        sender, gpu_driven = self.sender, self.exchanges.gpu_driven
        return self._coalesce_s if sender and sender.covers_all and gpu_driven else 0.0

    def publish(self, step: Step, mark: Callable[[str, float], float] | None = None) -> None:
        """An attention sender's step: its payload stamped (a refusal or a lost set raises
        here), sent straight to its FFN subscribers on this host, then queued for afd-ctl.
        `mark(part, started)`: the caller's clock of its parts (the direct copies: "direct")."""
        payload = step.to_payload()
        self.client.stamp(payload)  # its epoch and sender rank
        sending = time.perf_counter()
        self.send_direct(payload)  # first: afd-ctl's publish thread takes the GIL
        if mark is not None:
            mark("direct", sending)
        self.client.publish(payload, stamp=False)

    def send_direct(self, payload: afd_pb2.AFDControlPayload) -> None:
        """An attention sender: `payload` (published, so stamped) to its FFN subscribers on
        this host, if any."""
        if self.sender is not None:
            self.sender.send(payload)

    def close_direct(self) -> None:
        if self._sock is not None:
            if self.inbox is not None:
                self.inbox.close()
            self._sock.close()
            self._sock = None

    def close(self, reason: str) -> None:
        """Leaves afd-ctl saying why (every peer's PEER_LOST says "left: <reason>")."""
        self.client.close(reason=reason)
        self.close_direct()


def _step_socket(who: str) -> direct.StepSocket | None:
    """This worker's socket for direct step payloads, or None (the relay only) where there
    can be none."""
    if not direct.supported():
        return None
    try:
        return direct.StepSocket()
    except OSError as exc:
        log.warning("afd %s: step payloads go through afd-ctl only: %s", who, exc)
        return None
