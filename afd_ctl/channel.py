"""Client-side channel construction shared by the worker client and the CLI."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.experimental

DEFAULT_CONTROLLER = "127.0.0.1:50051"


def keepalive_options(liveness_timeout_s: float) -> list[tuple[str, int]]:
    """HTTP/2 pings every half bound, each answered within the other half, or the peer is dead."""
    half_ms = max(100, int(liveness_timeout_s * 1000 / 2))
    return [
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 50),
        ("grpc.http2.max_ping_strikes", 0),
    ]


@dataclass(frozen=True)
class ClientTls:
    """TLS towards the daemon: the CA that signed its certificate ("": the system's CAs), and
    for mTLS our own pair."""

    ca_cert: str
    client_cert: str = ""
    client_key: str = ""
    server_name: str = ""

    @classmethod
    def from_env(cls) -> ClientTls | None:
        ca = os.environ.get("AFD_CTL_TLS_CA", "")
        if not ca:
            return None
        return cls(
            ca,
            os.environ.get("AFD_CTL_TLS_CLIENT_CERT", ""),
            os.environ.get("AFD_CTL_TLS_CLIENT_KEY", ""),
            os.environ.get("AFD_CTL_TLS_SERVER_NAME", ""),
        )


def open_channel(
    target: str, tls: ClientTls | None = None, liveness_timeout_s: float = 2.0
) -> grpc.Channel:
    options: list[tuple[str, object]] = [
        *keepalive_options(liveness_timeout_s),
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.enable_retries", 0),
        (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
        # Reconnect quickly after the daemon restarts; the client adds its own backoff.
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca_cert).read_bytes() if tls.ca_cert else None,
        private_key=Path(tls.client_key).read_bytes() if tls.client_key else None,
        certificate_chain=Path(tls.client_cert).read_bytes() if tls.client_cert else None,
    )
    return grpc.secure_channel(target, credentials, options=options)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
