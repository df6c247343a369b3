"""TransportConfig: the one frozen config of the data plane.

It sizes the buffers registered at start-up (so every peer must use equal shape fields; the
blob carries them and ``connect`` compares) and bounds every wait.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from afd_ctl.config import parse_setting
from afd_ctl.routing import group_count
from afd_data.errors import AfdBadInput
from afd_data.gpu_protocol import FLAG_RESET_SETTINGS

logger = logging.getLogger(__name__)

# Accepted spellings -> canonical name, and the canonical name's size in bytes.
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "int32": "int32",
    "int64": "int64",
}
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8}
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
ENV_PREFIX = "AFD_DATA_"


def canonical_dtype(name: object, *, allowed: tuple[str, ...] = tuple(DTYPE_SIZES)) -> str:
    """Maps "bf16", "torch.bfloat16", "float32", ... to a canonical dtype name."""
    text = str(name).strip().lower().removeprefix("torch.").removeprefix("numpy.")
    canonical = _DTYPE_ALIASES.get(text)
    if canonical is None or canonical not in allowed:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(allowed)}")
    return canonical


def parse_port_range(text: str) -> tuple[int, int] | None:
    """(LOW, HIGH) of "LOW-HIGH" with 1024 <= LOW <= HIGH <= 65535; None for anything else."""
    low, sep, high = str(text).strip().partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        return None
    lo, hi = int(low), int(high)
    return (lo, hi) if 1024 <= lo <= hi <= 65535 else None


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Shape of the data plane plus its bounds. Shape fields must match on every peer."""

    # --- shape: sizes the registered buffers; equal on all peers -------------------------
    hidden_size: int
    # Most tokens one attention DP rank contributes to one stage of a step.
    max_tokens_per_peer: int
    dtype: str = "bfloat16"
    # Micro-batches per step: 1, or 2 under dual-batch overlap.
    num_stages: int = 1
    # Receive slots per stage: slot = layer % layers_in_flight. 1 suffices when every layer
    # needs the previous layer's output; more lets a sender run ahead.
    layers_in_flight: int = 1
    # The model's layers: every step runs layers 0 .. num_layers - 1, one round trip each per
    # stage (0: not known). With them the GPU-driven hop meets its flags without writing them
    # back (afd_data.gpu_protocol.flag_use); gpu_flag_resets "each" keeps the write-back (the
    # protocol before 2026-12-07, for comparison), "auto" the default.
    num_layers: int = 0
    gpu_flag_resets: str = "auto"
    # Extra per-token columns sent with the hidden states (router logits or top-k ids when the
    # gate stays on the attention side); 0 sends none.
    router_width: int = 0
    router_dtype: str = "float32"
    # M attention and N FFN role ranks; the routing and buffer counts follow from them.
    num_attention: int = 1
    num_ffn: int = 1
    # FFN groups of the routing (afd_ctl.routing): 1..min(M, N), the same on every worker (the
    # vLLM extension takes afd-ctl's, from --expert-parallel-size). 0: min(M, N), the default;
    # construction resolves it, so the field always holds the number in use.
    ffn_groups: int = 0
    # Issue 37, elastic membership (`afd-ctl scale`): the most attention and FFN ranks the
    # buffers are sized for. 0 and 0: a fixed membership (num_attention:num_ffn, the exact
    # buffers). Either set (the other 0 means its start-up count): every connect takes the M, N
    # and groups of the control plane's view, within these, so a peer joins or leaves without
    # reallocating; every worker of the deployment must say the same.
    max_attention: int = 0
    max_ffn: int = 0
    # Attention role rank = dp_rank * attention_tp_size + tp_rank.
    attention_tp_size: int = 1
    # --- bounds and polling --------------------------------------------------------------
    # Default bound of one receive (hidden states or outputs) before the peer counts as lost.
    recv_timeout_s: float = 30.0
    # Bound of one local transfer completion (a slot reused, a flush).
    transfer_timeout_s: float = 10.0
    # While a wait lasts longer than this, probe the awaited peers with a tiny notification so
    # a dead one surfaces as a NIXL disconnect long before the receive bound.
    probe_interval_s: float = 0.1
    # A wait spins on NIXL this long, then yields the CPU between polls (sched_yield: full
    # speed on an idle core, the core handed over when anything else wants it) this long,
    # then sleeps this long between polls.
    poll_spin_us: float = 100.0
    poll_yield_us: float = 10000.0
    poll_sleep_us: float = 20.0
    # NIXL progress thread; off by default (on small hosts it starves the workers, and the
    # transport polls NIXL itself in every wait and in flush()).
    progress_thread: bool = False
    # Prepared transfer handles kept per peer (keyed by slot, offset and row count).
    handles_per_peer: int = 1024
    # --- network surface -----------------------------------------------------------------
    # TCP ports UCX listens on, "LOW-HIGH" (UCX_TCP_PORT_RANGE for this worker's NIXL agent;
    # a firewall or NetworkPolicy admits exactly these between the attention and FFN hosts),
    # or "0" for ports the kernel picks. Each worker takes a port per network interface (2 on
    # a host with one interface besides loopback) from the range; UCX waits for a free one
    # when the range is full, so size it for every worker on the host. UCX_TCP_PORT_RANGE, when
    # set in the environment, wins.
    tcp_port_range: str = "41000-41999"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        try:
            set_(self, "dtype", canonical_dtype(self.dtype, allowed=HIDDEN_DTYPES))
        except ValueError as e:
            raise AfdBadInput(f"TransportConfig.dtype: {e}") from None
        try:
            set_(self, "router_dtype", canonical_dtype(self.router_dtype))
        except ValueError as e:
            raise AfdBadInput(f"TransportConfig.router_dtype: {e}") from None
        for name in (
            "hidden_size",
            "max_tokens_per_peer",
            "layers_in_flight",
            "num_attention",
            "num_ffn",
            "attention_tp_size",
            "handles_per_peer",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AfdBadInput(f"TransportConfig.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.ffn_groups, bool) or not isinstance(self.ffn_groups, int):
            raise AfdBadInput(
                f"TransportConfig.ffn_groups must be an integer, got {self.ffn_groups!r}"
            )
        try:
            groups = group_count(self.num_attention, self.num_ffn, self.ffn_groups or None)
        except ValueError as e:
            raise AfdBadInput(f"TransportConfig.ffn_groups: {e}") from None
        set_(self, "ffn_groups", groups)
        for name in ("max_attention", "max_ffn", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AfdBadInput(f"TransportConfig.{name} must be an integer >= 0, got {value!r}")
        if self.max_attention or self.max_ffn:
            set_(self, "max_attention", self.max_attention or self.num_attention)
            set_(self, "max_ffn", self.max_ffn or self.num_ffn)
            for name, count in (("attention", self.num_attention), ("ffn", self.num_ffn)):
                if count > getattr(self, f"max_{name}"):
                    raise AfdBadInput(
                        f"TransportConfig.num_{name} ({count}) is above max_{name} "
                        f"({getattr(self, f'max_{name}')}), the most the buffers are sized for"
                    )
            if self.max_attention % self.attention_tp_size:
                raise AfdBadInput(
                    f"TransportConfig.max_attention ({self.max_attention}) must be a multiple "
                    f"of attention_tp_size ({self.attention_tp_size})"
                )
        if self.gpu_flag_resets not in FLAG_RESET_SETTINGS:
            raise AfdBadInput(
                f"TransportConfig.gpu_flag_resets must be {' or '.join(FLAG_RESET_SETTINGS)}, "
                f"got {self.gpu_flag_resets!r}"
            )
        if self.num_stages not in (1, 2):
            raise AfdBadInput(f"TransportConfig.num_stages must be 1 or 2, got {self.num_stages!r}")
        if not isinstance(self.router_width, int) or self.router_width < 0:
            raise AfdBadInput(
                f"TransportConfig.router_width must be >= 0, got {self.router_width!r}"
            )
        if self.num_attention % self.attention_tp_size:
            raise AfdBadInput(
                f"TransportConfig.num_attention ({self.num_attention}) must be a multiple of "
                f"attention_tp_size ({self.attention_tp_size})"
            )
        for name in ("recv_timeout_s", "transfer_timeout_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise AfdBadInput(
                    f"TransportConfig.{name} must be > 0, got {getattr(self, name)!r}"
                )
        if parse_port_range(self.tcp_port_range) is None and self.tcp_port_range != "0":
            raise AfdBadInput(
                "TransportConfig.tcp_port_range must be LOW-HIGH (1024 <= LOW <= HIGH <= "
                f"65535) or 0, got {self.tcp_port_range!r}"
            )
        for name in ("poll_spin_us", "poll_yield_us", "poll_sleep_us"):
            if getattr(self, name) < 0:
                raise AfdBadInput(
                    f"TransportConfig.{name} must be >= 0, got {getattr(self, name)!r}"
                )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def router_itemsize(self) -> int:
        return DTYPE_SIZES[self.router_dtype]

    @property
    def elastic(self) -> bool:
        """Sized for a membership that may change (max_attention / max_ffn set)."""
        return bool(self.max_attention)

    def with_routing(self, num_attention: int, num_ffn: int, ffn_groups: int) -> TransportConfig:
        """The same buffers routed for another membership (a control plane's view); AfdBadInput
        naming the bound when this config was not sized for it."""
        routing = (num_attention, num_ffn, ffn_groups)
        if routing == (self.num_attention, self.num_ffn, self.ffn_groups):
            return self
        if not self.elastic:
            raise AfdBadInput(
                f"the membership moved to {num_attention}:{num_ffn} ({ffn_groups} FFN "
                f"group(s)) but this data plane was sized for exactly {self.num_attention}:"
                f"{self.num_ffn}; start the workers with max_attention / max_ffn (afd "
                "max_attention / max_ffn with vLLM) to follow afd-ctl scale"
            )
        if num_attention > self.max_attention or num_ffn > self.max_ffn:
            raise AfdBadInput(
                f"the membership moved to {num_attention}:{num_ffn} but this data plane was "
                f"sized for at most {self.max_attention}:{self.max_ffn} (max_attention, "
                "max_ffn); start the workers sized for the largest membership"
            )
        return dataclasses.replace(
            self, num_attention=num_attention, num_ffn=num_ffn, ffn_groups=ffn_groups
        )

    @property
    def attention_dp_size(self) -> int:
        """Length of every ``num_tokens_across_dp`` list."""
        return self.num_attention // self.attention_tp_size

    def shape_fields(self) -> dict[str, Any]:
        """The fields that must be equal on every peer (what the blob carries)."""
        return {
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "router_width": self.router_width,
            "router_dtype": self.router_dtype,
            "max_tokens_per_peer": self.max_tokens_per_peer,
            "num_stages": self.num_stages,
            "layers_in_flight": self.layers_in_flight,
            "num_layers": self.num_layers,
            "gpu_flag_resets": self.gpu_flag_resets,
            "num_attention": self.num_attention,
            "num_ffn": self.num_ffn,
            "ffn_groups": self.ffn_groups,
            "attention_tp_size": self.attention_tp_size,
            "max_attention": self.max_attention,
            "max_ffn": self.max_ffn,
        }

    def compared_shape_fields(self) -> dict[str, Any]:
        """The shape fields a peer must match: with an elastic membership the routing ones
        (M, N, groups) are each connect's, only the bounds the buffers were sized for count."""
        fields = self.shape_fields()
        if self.elastic:
            for name in ("num_attention", "num_ffn", "ffn_groups"):
                del fields[name]
        return fields

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **flags: Any) -> TransportConfig:
        """Flags first, then ``AFD_DATA_<FIELD>`` environment variables, then defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in flags and flags[field.name] is not None:
                values[field.name] = flags[field.name]
                continue
            variable = ENV_PREFIX + field.name.upper()
            raw = env.get(variable)
            if raw is None:
                continue
            try:
                values[field.name] = parse_setting(variable, raw, field)
            except ValueError as exc:
                raise AfdBadInput(str(exc)) from None
        unknown = set(flags) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise AfdBadInput(f"unknown TransportConfig fields: {', '.join(sorted(unknown))}")
        return cls(**values)
