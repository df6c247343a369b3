"""AFD settings of one vLLM worker: one frozen dataclass, built from `additional_config["afd"]`
(which the --afd-* flags fill), then AFD_* environment variables, then defaults."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from afd_ctl.config import parse_setting
from afd_ctl.direct import RELAY_COALESCE_S
from afd_ctl.routing import Role

FFN_POLL_S = 0.0  # afd ffn_poll_s's default

ROLES = tuple(role.label for role in Role)  # as --afd-role spells them
GATE_SIDES = ("ffn", "attention")
DIRECT_PAYLOADS = ("auto", "on", "off")
ENV_PREFIX = "AFD_"
# Keys accepted under additional_config["afd"]; each is also AFD_<KEY> in the environment.


@dataclass(frozen=True)
class AfdConfig:
    """What a worker needs to take part in AFD. Times are bounds: nothing waits forever."""

    controller: str
    # "attention" or "ffn" (any case) in; a Role once constructed.
    role: Role
    # Stable identity for afd-ctl; default "<role>-dp<rank>" (attention) or "ffn-<pid>".
    worker_id: str = ""
    # Bound on registering and (attention role) on waiting for the expected set at start-up;
    # an FFN server waits for its attention peers as long as it runs.
    connect_timeout_s: float = 120.0
    # Within that bound, connection refused on every try this long (nothing listens at the
    # address) or a host name that does not resolve ends the start-up sooner, saying so.
    # Raise it to connect_timeout_s where workers may start before afd-ctl listens.
    refused_timeout_s: float = 5.0
    # Bound on one layer's round trip (attention) and on one payload or hidden-state wait (FFN).
    step_timeout_s: float = 10.0
    # The same bound for warm-up, profile and CUDA-graph capture steps (the payload's flags):
    # the attention side compiles its model (torch.compile) and captures graphs inside them,
    # which takes seconds on a tiny model and minutes on a real one.
    warmup_timeout_s: float = 600.0
    # Maximum tokens per attention rank per step the data plane sizes its buffers for; 0 means
    # vLLM's max_num_batched_tokens.
    max_tokens: int = 0
    # Torch profiler: write traces to this folder for steps [profile_start_step, +profile_steps).
    profile_dir: str = ""
    profile_start_step: int = 10
    profile_steps: int = 5
    log_level: str = "INFO"
    # FFN role: this server's FFN rank, below the number of FFN ranks afd-ctl expects (or,
    # for a server joining an `afd-ctl scale` target, the target's).
    ffn_rank: int = 0
    # Attention role, a server of data-parallel size 1: its attention rank when several
    # `vllm serve --afd-role attention` servers (each with its own API, behind a load balancer)
    # serve one deployment, each with an FFN group of its own; below the attention ranks
    # afd-ctl expects (or, joining an `afd-ctl scale` target, the target's).
    attention_rank: int = 0
    # Issue 37, elastic membership: the most attention and FFN ranks this worker's data plane
    # is sized for. Either set, the worker follows `afd-ctl scale` (it holds at a change's
    # fence and reconnects to the new epoch; one the change leaves out exits 0) up to that
    # size, and a peer joins without reallocating; every worker must say the same. 0 and 0:
    # a fixed membership, sized exactly, which afd-ctl scale refuses to change.
    max_attention: int = 0
    max_ffn: int = 0
    # Where the MoE router gate runs: "ffn" (with the experts) or "attention" (the attention
    # side computes the router logits and sends them with the hidden states). Both roles must
    # say the same; the data plane refuses peers that disagree.
    gate: str = "ffn"
    # No longer needed (accepted, warned about and ignored): TP rank 0 of an attention server
    # exchanges for its TP group (vllm_ext.attention.tp_group), so FFN servers need not know the TP size.
    attention_tp_size: int = 1
    # FFN role: micro-batches per step this server's data plane carries. 2 (the default)
    # follows attention servers with or without dual-batch overlap, for twice the receive and
    # send buffers of 1; 1 saves that memory and refuses attention servers that overlap.
    num_stages: int = 2
    # TLS towards afd-ctl (PEM paths): the CA that signed the daemon's certificate and, for
    # mTLS, this worker's certificate and key. Empty tls_ca: AFD_CTL_TLS_* as `afd-ctl`'s own
    # commands read them, else plaintext.
    tls_ca: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    tls_server_name: str = ""
    # A file holding the bearer token of `afd-ctl serve --auth-token`; empty: the
    # AFD_CTL_AUTH_TOKEN environment variable. The token itself is never a setting, so it
    # stays out of `ps`, the logs and vLLM's config hash (vllm_ext.control reads it).
    auth_token_file: str = ""
    # Prometheus /metrics of this worker's AFD series on this port (FFN role; 0: off). The
    # attention role's series are on the API server's own /metrics.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # What the model fingerprint's weights digest reads (vllm_ext.weights_digest): "content"
    # (tensor names, shapes and every byte of the shards; cached per file) or "headers" (names
    # and shapes only: cheap, blind to values). Both roles must say the same.
    weights_digest: str = "content"
    # Where shard digests are cached by file identity; empty: ~/.cache/afd-ctl/weights-digest.
    weights_digest_cache: str = ""
    # Step payloads also straight from the attention sender to its FFN workers on the same host
    # (afd_ctl.direct: a Unix datagram, no daemon hop); afd-ctl relays and checks each one all
    # the same. "auto": where the data plane runs the GPU-driven exchange (the FFN host only
    # enqueues each step, so an earlier payload is all gain; on the host-driven path it only
    # makes the FFN host poll for rows longer, which on a CPU machine of few cores slows the
    # attention side); "on": on either path; "off": the relay only.
    direct_payloads: str = "auto"
    # While every FFN subscriber takes the payloads directly on the GPU-driven path, the
    # sender's copies to afd-ctl may wait this long for the next ones, to go several to a
    # message (afd_ctl.publisher): status and taps see payloads that much later. 0: never wait.
    publish_coalesce_s: float = RELAY_COALESCE_S
    # FFN role on the GPU-driven path: after each step, look for the next direct payload
    # without sleeping for this long (one core busy meanwhile), so the sender's datagram wakes
    # nobody. 0 (the default): sleep at once. On the 2-core CPU machine it cut AFD's time on
    # the attention host by a third (benchmarks/attention_host_step.py), on a 16-core GPU host
    # not at all (a wake-up costs 4.5 µs there): off until a GPU run shows a gain. The
    # host-driven path never polls (a spinning FFN host there takes a core the attention side
    # needs on a small CPU machine).
    ffn_poll_s: float = FFN_POLL_S

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role.parse(self.role))
        except ValueError:
            raise ValueError(f"afd role must be one of {ROLES}, got {self.role!r}") from None
        _check_controller(self.controller)
        bounds = (self.connect_timeout_s, self.step_timeout_s, self.warmup_timeout_s)
        if min(*bounds, self.refused_timeout_s) <= 0:
            raise ValueError(
                "afd connect_timeout_s, refused_timeout_s, step_timeout_s and warmup_timeout_s "
                "must be > 0"
            )
        if self.max_tokens < 0:
            raise ValueError(f"afd max_tokens must be >= 0, got {self.max_tokens}")
        if self.gate not in GATE_SIDES:
            raise ValueError(f"afd gate must be one of {GATE_SIDES}, got {self.gate!r}")
        if self.attention_tp_size < 1:
            raise ValueError(f"afd attention_tp_size must be >= 1, got {self.attention_tp_size}")
        if self.num_stages not in (1, 2):
            raise ValueError(f"afd num_stages must be 1 or 2, got {self.num_stages}")
        if self.max_attention < 0 or self.max_ffn < 0:
            raise ValueError("afd max_attention and max_ffn must be >= 0 (0: a fixed membership)")
        if self.ffn_rank < 0 or self.attention_rank < 0:
            raise ValueError(
                f"afd ffn_rank and attention_rank must be >= 0, got {self.ffn_rank} and "
                f"{self.attention_rank}"
            )
        if self.profile_steps < 1 or self.profile_start_step < 0:
            raise ValueError("afd profile_steps must be >= 1 and profile_start_step >= 0")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ValueError("afd tls_client_cert and tls_client_key go together (mTLS)")
        if self.tls_client_cert and not self.tls_ca:
            raise ValueError("afd tls_client_cert needs tls_ca (the CA of afd-ctl's certificate)")
        if self.weights_digest not in ("content", "headers"):
            raise ValueError(
                f"afd weights_digest must be content or headers, got {self.weights_digest!r}"
            )
        if not 0 <= self.publish_coalesce_s <= 1:
            raise ValueError(
                f"afd publish_coalesce_s must be in 0..1 s, got {self.publish_coalesce_s}"
            )
        if not 0 <= self.ffn_poll_s <= 1:
            raise ValueError(f"afd ffn_poll_s must be in 0..1 s, got {self.ffn_poll_s}")
        if isinstance(self.direct_payloads, bool):  # JSON true / false
            object.__setattr__(self, "direct_payloads", "on" if self.direct_payloads else "off")
        if self.direct_payloads not in DIRECT_PAYLOADS:
            raise ValueError(
                f"afd direct_payloads must be one of {DIRECT_PAYLOADS}, got {self.direct_payloads!r}"
            )
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"afd metrics_port must be in 0..65535, got {self.metrics_port}")

    @property
    def elastic(self) -> bool:
        """Sized to follow `afd-ctl scale` (max_attention / max_ffn set)."""
        return bool(self.max_attention or self.max_ffn)

    def describe(self) -> str:
        values = dataclasses.asdict(self) | {"role": self.role.label}
        return " ".join(f"{k}={v}" for k, v in values.items())

    @classmethod
    def resolve(
        cls, section: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> AfdConfig | None:
        """The config, or None when neither the section nor AFD_ROLE asks for AFD."""
        environ = os.environ if environ is None else environ
        section = dict(section or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in --additional-config afd section; "
                f"known: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in section and section[name] not in (None, ""):
                values[name] = section[name]
                continue
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            values[name] = parse_setting(ENV_PREFIX + name.upper(), raw, f)
        if "role" not in values and "controller" not in values:
            return None
        if "role" not in values:
            raise ValueError("afd controller is set but the role is not: add --afd-role")
        if "controller" not in values:
            raise ValueError("afd role is set but the controller is not: add --afd-controller")
        return cls(**values)


def _check_controller(controller: str) -> None:
    """HOST:PORT (a port in 1..65535) or unix:PATH, as `afd-ctl serve --listen` takes it."""
    if controller.startswith("unix:") and len(controller) > len("unix:"):
        return
    host, _, port = controller.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        example = f"{controller or 'localhost'}:50051" if not host else f"{host}:50051"
        raise ValueError(
            f"--afd-controller (afd controller) must be HOST:PORT or unix:PATH of `afd-ctl "
            f"serve`, got {controller!r}; e.g. {example}"
        )


def afd_section(additional_config: Any) -> dict[str, Any] | None:
    """`additional_config["afd"]` as a dict, or None; accepts the dict or a JSON string."""
    if not additional_config:
        return None
    if isinstance(additional_config, str):
        import json

        additional_config = json.loads(additional_config)
    section = additional_config.get("afd") if isinstance(additional_config, Mapping) else None
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"additional_config['afd'] must be an object, got {section!r}")
    return dict(section)


def from_vllm_config(vllm_config: Any) -> AfdConfig | None:
    """The AFD config of a VllmConfig (its additional_config), or None."""
    return AfdConfig.resolve(afd_section(getattr(vllm_config, "additional_config", None)))
