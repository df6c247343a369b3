"""How vllm_ext reaches afd-ctl: the one place that turns the AFD config into a channel (TLS,
mTLS) and the bearer token, for every call the extension makes: the workers' sessions
(ControllerClient), the start-up query of the expected counts and the API server's /health
check. A daemon started with --auth-token, --tls-cert or --tls-client-ca is reached the same
way by all of them.

The token comes from AFD_CTL_AUTH_TOKEN (the variable `afd-ctl`'s own commands read) or from
the file named by the `auth_token_file` setting, never from a setting itself: settings travel
in vLLM's additional_config, which is logged, hashed and visible in `ps`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from afd_ctl.channel import ClientTls, auth_metadata, open_channel

if TYPE_CHECKING:
    from afd_ctl.client import ControllerClient, WorkerSpec
    from afd_ctl.v1 import afd_pb2
    from vllm_ext.config import AfdConfig

TOKEN_ENV = "AFD_CTL_AUTH_TOKEN"
# Refusals that no retry fixes: the credentials are wrong.
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class AfdCredentialsRefused(RuntimeError):
    """afd-ctl refused this worker's token or certificate; a setting must change."""


@dataclass(frozen=True)
class ControlAccess:
    """Address, TLS and token of afd-ctl, as one worker reaches it."""

    controller: str
    tls: ClientTls | None = None
    token: str = field(default="", repr=False)  # never in a repr, so never in a log line

    @classmethod
    def of(cls, afd: AfdConfig) -> ControlAccess:
        """From the AFD settings; reads the token file (or AFD_CTL_AUTH_TOKEN) and checks
        the PEM files exist, naming the setting that points elsewhere."""
        tls: ClientTls | None
        if afd.tls_ca:
            for name in ("tls_ca", "tls_client_cert", "tls_client_key"):
                path = getattr(afd, name)
                if path and not Path(path).is_file():
                    raise ValueError(f"afd {name} {path!r}: no such file")
            tls = ClientTls(
                afd.tls_ca, afd.tls_client_cert, afd.tls_client_key, afd.tls_server_name
            )
        else:
            tls = ClientTls.from_env()
        return cls(afd.controller, tls, _token(afd.auth_token_file))

    def describe(self) -> str:
        """For a log line: how afd-ctl is reached, without the token."""
        how = "plaintext" if self.tls is None else "TLS"
        if self.tls is not None and self.tls.client_cert:
            how = "mTLS"
        return f"{self.controller} ({how}, {'a' if self.token else 'no'} bearer token)"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return auth_metadata(self.token)

    def channel(self) -> grpc.Channel:
        return open_channel(self.controller, self.tls)

    def client(self, spec: WorkerSpec, data_plane_blob: bytes) -> ControllerClient:
        from afd_ctl.client import ControllerClient

        return ControllerClient(
            self.controller, spec, data_plane_blob=data_plane_blob, token=self.token, tls=self.tls
        )

    def refused(self, exc: grpc.RpcError) -> AfdCredentialsRefused | None:
        """The error to raise when `exc` says the credentials are wrong; else None."""
        if exc.code() not in REFUSED:
            return None
        return AfdCredentialsRefused(
            f"afd-ctl at {self.controller} refused this worker: {exc.code().name}: "
            f"{exc.details()}. The bearer token comes from {TOKEN_ENV} or the file named by "
            "afd auth_token_file (AFD_AUTH_TOKEN_FILE) and must equal the daemon's "
            "--auth-token; a daemon with --tls-client-ca also needs afd tls_client_cert and "
            "tls_client_key"
        )


class StatusQuery:
    """GetStatus on one reused channel (the API server asks every /health)."""

    def __init__(self, access: ControlAccess) -> None:
        self.access = access
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def get(self, timeout_s: float) -> afd_pb2.GetStatusResponse:
        """Raises grpc.RpcError as the call does; AfdCredentialsRefused for wrong credentials."""
        from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

        if self._stub is None:
            self._channel = self.access.channel()
            self._stub = afd_pb2_grpc.AFDInspectStub(self._channel)
        try:
            return self._stub.GetStatus(
                afd_pb2.GetStatusRequest(), timeout=timeout_s, metadata=self.access.metadata
            )
        except grpc.RpcError as exc:
            refused = self.access.refused(exc)
            if refused is not None:
                raise refused from None
            raise

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def _token(path: str) -> str:
    if not path:
        return os.environ.get(TOKEN_ENV, "").strip()
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"afd auth_token_file {path!r}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"afd auth_token_file {path!r} is empty")
    return token
