"""TLS, mTLS and the bearer token: accepted with the right credentials, rejected without."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from afd_ctl.channel import ClientTls
from afd_ctl.cli import main as cli
from afd_ctl.client import ControllerClient
from afd_ctl.errors import AfdRejected, AfdTimeout
from afd_ctl.membership import FFN, WorkerSpec

TOKEN = "s3cret-token"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=afd-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "")):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        extra = ["-extfile", f"{name}.ext"] if ext else []
        if ext:
            (d / f"{name}.ext").write_text(ext + "\n")
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            f"{name}.pem",
            *extra,
            cwd=d,
        )
    return d


def register(address: str, tls: ClientTls | None, token: str = "", timeout: float = 5) -> None:
    client = ControllerClient(address, WorkerSpec("ffn-0", FFN), tls=tls, token=token)
    try:
        client.connect(timeout)
    finally:
        client.close()


def test_tls_and_token(start_daemon, pki: Path):
    daemon = start_daemon(
        "--tls-cert",
        str(pki / "server.pem"),
        "--tls-key",
        str(pki / "server.key"),
        "--auth-token",
        TOKEN,
    )
    tls = ClientTls(str(pki / "ca.pem"))
    register(daemon.address, tls, TOKEN)
    with pytest.raises(AfdRejected, match="UNAUTHENTICATED: authorization metadata is missing"):
        register(daemon.address, tls)
    with pytest.raises(AfdRejected, match="UNAUTHENTICATED: authorization token is wrong"):
        register(daemon.address, tls, "guess")
    with pytest.raises(AfdTimeout):  # plaintext against a TLS port never gets through
        register(daemon.address, None, TOKEN, timeout=2)
    tls_flags = ["--controller", daemon.address, "--tls-ca", str(pki / "ca.pem")]
    assert cli(["status", *tls_flags, "--token", TOKEN]) == 0
    assert cli(["status", *tls_flags]) == 1


def test_mutual_tls_requires_a_client_certificate(start_daemon, pki: Path):
    daemon = start_daemon(
        "--tls-cert",
        str(pki / "server.pem"),
        "--tls-key",
        str(pki / "server.key"),
        "--tls-client-ca",
        str(pki / "ca.pem"),
    )
    register(
        daemon.address,
        ClientTls(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key")),
    )
    with pytest.raises(AfdTimeout):
        register(daemon.address, ClientTls(str(pki / "ca.pem")), timeout=2)


def test_bad_daemon_flags_fail_fast_with_a_clear_message(tmp_path: Path):
    for args, message in (
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", "x"], "no such file"),
        (["--expect-ffn", "0"], "--expect-attention and --expect-ffn must be >= 1"),
        (["--listen", "nowhere"], "--listen must be HOST:PORT or unix:PATH"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "afd_ctl.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
