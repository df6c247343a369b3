"""Client-side channel construction shared by the worker client and the CLI."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc
import grpc.experimental

from afd_ctl.tls import channel_credentials

DEFAULT_CONTROLLER = "127.0.0.1:50051"
# The shortest bound of a client's keepalive pings of the daemon (open_channel says why).
CLIENT_KEEPALIVE_MIN_S = 10.0


def keepalive_options(liveness_timeout_s: float) -> list[tuple[str, int]]:
    """HTTP/2 pings every quarter of the bound, each answered within the other three quarters,
    or the peer is dead: found within the bound, while one late answer (a stalled network
    path, a loaded host) is tolerated for 3/4 of it. grpc's C core sends and answers them,
    so a busy Python on either side misses none."""
    bound_ms = max(200, int(liveness_timeout_s * 1000))
    interval_ms, timeout_ms = bound_ms // 4, bound_ms - bound_ms // 4
    return [
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # Every ping's ack bound (grpcio's default is 60 s): without it, a ping sent while the
        # stream carries data (the keepalive timer is reset by traffic) waits a minute.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
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
    """A channel to the daemon; afd_ctl.tls.TlsFileError (one line naming the file) when a TLS
    file is missing or bad."""
    options: list[tuple[str, object]] = [
        # A worker's own pings only find a frozen daemon or a cut path (a dead daemon closes
        # the connection at once), and a false alarm hangs up a live session, which fails a
        # step on every worker: they get at least CLIENT_KEEPALIVE_MIN_S (a client's ping
        # timed out after 1.5 s on a loaded 2-core machine). The daemon's pings of the workers
        # keep the liveness bound (afd_ctl.server).
        *keepalive_options(max(liveness_timeout_s, CLIENT_KEEPALIVE_MIN_S)),
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
    credentials = channel_credentials(tls.ca_cert, tls.client_cert, tls.client_key)
    return grpc.secure_channel(target, credentials, options=options)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The token as call metadata (the daemon takes the scheme in any case, RFC 7235)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# How often in a row a connection closed during the handshake, before anything was
# registered, is taken as a refusal of this client's TLS settings rather than a passing fault.
CLOSED_IN_HANDSHAKE_STRIKES = 3


def tls_problem(details: str, target: str, tls: ClientTls | None) -> tuple[str, bool] | None:
    """What an UNAVAILABLE call's `details` say about TLS, if anything: (one line naming the
    files and the mismatch, whether it is certain). A certain one (the daemon's certificate
    fails this client's checks, or the daemon does not speak TLS) is never transient; a
    connection the daemon closed during the handshake (it refused our certificate, or we sent
    it plaintext) is only taken as one when it repeats (CLOSED_IN_HANDSHAKE_STRIKES)."""
    ca = f"the CA in {tls.ca_cert}" if tls is not None and tls.ca_cert else "the system's CAs"
    if "Hostname Verification" in details or "Peer name" in details:
        name = (tls.server_name if tls is not None else "") or target.rpartition(":")[0]
        return (
            f"TLS to afd-ctl at {target}: its certificate does not name {name!r}; connect by "
            "a name or address the daemon's --tls-cert lists, or set the name it lists "
            "(afd tls_server_name, AFD_CTL_TLS_SERVER_NAME)",
            True,
        )
    if "WRONG_VERSION_NUMBER" in details:
        return (
            f"TLS to afd-ctl at {target}: it does not speak TLS (WRONG_VERSION_NUMBER); drop "
            "the TLS settings, or start the daemon with --tls-cert and --tls-key",
            True,
        )
    if "CERTIFICATE_VERIFY_FAILED" in details or "andshake failed" in details:
        reason = details.rpartition("OPENSSL_internal:")[2].strip().removesuffix(": OK")
        return (
            f"TLS to afd-ctl at {target}: the handshake failed ({reason or details}); the "
            f"daemon's certificate must be signed by {ca}",
            True,
        )
    if details.rstrip().endswith("Socket closed"):
        if tls is None:
            hint = (
                "if it serves TLS (--tls-cert), give its CA (afd tls_ca, --tls-ca, AFD_CTL_TLS_CA)"
            )
        elif tls.client_cert:
            hint = (
                f"if it requires client certificates (--tls-client-ca), {tls.client_cert} "
                "must be signed by that CA"
            )
        else:
            hint = (
                "if it requires client certificates (--tls-client-ca), give a certificate "
                "and key signed by that CA (afd tls_client_cert and tls_client_key, "
                "--tls-cert and --tls-key)"
            )
        return f"afd-ctl at {target} closed the connection while it was set up: {hint}", False
    return None
