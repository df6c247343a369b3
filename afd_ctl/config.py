"""Daemon configuration: one frozen dataclass, built from flags, then AFD_CTL_* variables,
then defaults, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, fields

from afd_ctl.routing import group_count, groups_for_expert_parallel
from afd_ctl.tls import check_certificates, check_key_pair, read_file

DEFAULT_LISTEN = "127.0.0.1:50051"
ENV_PREFIX = "AFD_CTL_"


@dataclass(frozen=True)
class DaemonConfig:
    """Settings of `afd-ctl serve`. Each field can be set as --flag-name or AFD_CTL_FIELD_NAME."""

    listen: str = DEFAULT_LISTEN
    expect_attention: int = 1
    expect_ffn: int = 1
    # FFN ranks per group, which split the experts between them (E; N / E groups, each reached
    # by its own attention ranks). 0: the default grouping, min(M, N) groups; N: one group that
    # every attention rank reaches, each FFN rank holding 1/N of the experts.
    expert_parallel_size: int = 0
    # A worker whose session ends or whose connection stops answering grpc's keepalive pings
    # (answered in grpc's C core, so a busy Python does not miss them) is lost within this.
    liveness_timeout_s: float = 2.0
    # A worker whose connection is alive but whose Python has sent no heartbeat for this long
    # (a deadlock; far longer than any stretch a compile holds the GIL) is lost too.
    heartbeat_timeout_s: float = 60.0
    # Messages queued per worker session before a slow subscriber is cut off.
    subscriber_queue: int = 4096
    max_blob_bytes: int = 1 << 20
    # Health Watch streams (which need no token): open at once in total and per client host;
    # more are refused with RESOURCE_EXHAUSTED.
    max_watch_streams: int = 1024
    max_watch_streams_per_client: int = 64
    # Tap streams (`afd-ctl watch`; the token's, when there is one): a budget of their own, so
    # anonymous health Watch streams never lock an operator out.
    max_tap_streams: int = 64
    max_tap_streams_per_client: int = 16
    # Time the daemon gives workers to hang up after STOP on SIGTERM/SIGINT or `afd-ctl stop`.
    drain_grace_s: float = 5.0
    # 0: off; -1: a port the kernel picks, named in the "metrics on" log line.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_token: str = ""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.expect_attention < 1 or self.expect_ffn < 1:
            raise ValueError(
                "--expect-attention and --expect-ffn must be >= 1 "
                f"(got {self.expect_attention} and {self.expect_ffn})"
            )
        if self.expert_parallel_size:
            groups_for_expert_parallel(
                self.expect_attention, self.expect_ffn, self.expert_parallel_size
            )
        if not 0.2 <= self.liveness_timeout_s <= 600:
            raise ValueError(
                f"--liveness-timeout-s must be in [0.2, 600], got {self.liveness_timeout_s}"
            )
        if self.heartbeat_timeout_s < self.liveness_timeout_s:
            raise ValueError(
                f"--heartbeat-timeout-s ({self.heartbeat_timeout_s}) must be at least "
                f"--liveness-timeout-s ({self.liveness_timeout_s})"
            )
        if self.subscriber_queue < 8:
            raise ValueError(f"--subscriber-queue must be >= 8, got {self.subscriber_queue}")
        if not 0 < self.max_blob_bytes <= 1 << 20:
            raise ValueError(f"--max-blob-bytes must be in (0, 1 MiB], got {self.max_blob_bytes}")
        for kind in ("watch", "tap"):
            total = getattr(self, f"max_{kind}_streams")
            per_client = getattr(self, f"max_{kind}_streams_per_client")
            if not 1 <= per_client <= total:
                raise ValueError(
                    f"--max-{kind}-streams-per-client must be in [1, --max-{kind}-streams], got "
                    f"{per_client} and {total}"
                )
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(
                "--metrics-port must be a TCP port, 0 (off) or -1 (a free one, named in the "
                f"log), got {self.metrics_port}"
            )
        # A file that is given but missing is the first thing to fix: said before the pairing.
        for flag, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-client-ca", self.tls_client_ca),
        ):
            if path:
                read_file(path, flag)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key as well")
        # Missing, garbage or mismatched PEM files: one line naming the file, here at start.
        if self.tls_cert:
            check_key_pair(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key")
        if self.tls_client_ca:
            check_certificates(self.tls_client_ca, "--tls-client-ca")
        parse_listen(self.listen)

    @property
    def ffn_groups(self) -> int:
        """The number of FFN groups the routing uses (afd_ctl.routing)."""
        if self.expert_parallel_size:
            return groups_for_expert_parallel(
                self.expect_attention, self.expect_ffn, self.expert_parallel_size
            )
        return group_count(self.expect_attention, self.expect_ffn)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def describe(self) -> str:
        """One log line; the token itself is never logged."""
        shown = dataclasses.asdict(self)
        shown["auth_token"] = "set" if self.auth_token else "unset"
        return " ".join(f"{k}={v}" for k, v in shown.items())

    @classmethod
    def resolve(
        cls, flags: Mapping[str, object], environ: Mapping[str, str] | None = None
    ) -> DaemonConfig:
        """Flags (None = not given) win over AFD_CTL_* variables, which win over defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            given = flags.get(field.name)
            if given is not None:
                values[field.name] = given
                continue
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is None or raw == "":
                continue
            values[field.name] = parse_setting(ENV_PREFIX + field.name.upper(), raw, field)
        return cls(**values)  # type: ignore[arg-type]


TRUE_WORDS = ("1", "true", "yes", "on")
_KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def parse_setting(variable: str, raw: str, field: Field) -> object:
    """An environment variable's text as the type of the dataclass `field` (int, float, str, or
    bool: 1, true, yes or on, any case); ValueError naming the variable when it does not parse.
    Used by every settings class (afd-ctl's, the data plane's, the vLLM extension's)."""
    kind = field.type if isinstance(field.type, type) else _KINDS[str(field.type)]
    if kind is bool:
        return raw.strip().lower() in TRUE_WORDS
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not a valid {kind.__name__}") from None


def parse_listen(listen: str) -> tuple[str, int | None]:
    """Returns (host, port) for host:port, or (unix_path, None) for unix:PATH."""
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        if not path:
            raise ValueError("--listen unix:PATH needs a path")
        return path, None
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen must be HOST:PORT or unix:PATH, got {listen!r}")
    return host.strip("[]"), int(port)
