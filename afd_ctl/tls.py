"""TLS files, checked before gRPC sees them.

gRPC reports a garbage PEM or a key that does not belong to its certificate as a long traceback
ending in "Failed to bind to address" (daemon) and a missing file as a FileNotFoundError
(clients). Here each problem becomes one `TlsFileError` line naming the flag and the file.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


class TlsFileError(ValueError):
    """A TLS file that is missing, unreadable, not PEM, or not the key of its certificate."""


def read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TlsFileError(f"{flag} {path}: no such file") from None
    except OSError as error:
        raise TlsFileError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def check_certificates(path: str, flag: str) -> bytes:
    """The file's bytes, if it holds at least one PEM certificate."""
    data = read_file(path, flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise TlsFileError(
            f"{flag} {path}: not a PEM certificate (expected '-----BEGIN CERTIFICATE-----')"
        ) from None
    return data


def check_key_pair(cert: str, key: str, cert_flag: str, key_flag: str) -> tuple[bytes, bytes]:
    """(certificate chain, private key) bytes, if the key is the certificate's."""
    cert_pem = check_certificates(cert, cert_flag)
    key_pem = read_file(key, key_flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(
                f"{key_flag} {key} is not the private key of {cert_flag} {cert}"
            ) from None
        raise TlsFileError(
            f"{key_flag} {key}: not an unencrypted PEM private key "
            "(expected '-----BEGIN PRIVATE KEY-----')"
        ) from None
    return cert_pem, key_pem


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """The daemon's TLS (mTLS with `client_ca`); TlsFileError naming the file on a bad one."""
    cert_pem, key_pem = check_key_pair(cert, key, "--tls-cert", "--tls-key")
    ca_pem = check_certificates(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=ca_pem, require_client_auth=ca_pem is not None
    )


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """A client's TLS towards the daemon (with its own pair for mTLS); TlsFileError naming the
    file on a bad one. No CA file: the system's CAs check the daemon."""
    if bool(cert) != bool(key):
        raise TlsFileError("a TLS client certificate and its key go together: give both or neither")
    ca_pem = check_certificates(ca, "TLS CA") if ca else None
    pair = check_key_pair(cert, key, "TLS client certificate", "TLS client key") if cert else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem,
        private_key=pair[1] if pair else None,
        certificate_chain=pair[0] if pair else None,
    )
