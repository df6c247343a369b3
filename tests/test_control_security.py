"""TLS, mTLS and the bearer token: accepted with the right credentials, rejected without."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from afd_ctl.channel import ClientTls
from afd_ctl.cli import main as cli
from afd_ctl.client import ControllerClient
from afd_ctl.errors import AfdRejected
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from afd_ctl.sim_worker import make_payload
from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

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
    # Plaintext against a TLS port: the daemon closes every connection; after three in a row
    # connect() says what to check instead of retrying for its whole timeout.
    with pytest.raises(AfdRejected, match="closed the connection while it was set up: if it"):
        register(daemon.address, None, TOKEN, timeout=30)
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
    with pytest.raises(AfdRejected, match="requires client certificates"):
        register(daemon.address, ClientTls(str(pki / "ca.pem")), timeout=30)


def test_bad_daemon_flags_fail_fast_with_a_clear_message(tmp_path: Path):
    for args, message in (
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", "x"], "no such file"),
        # Issue 22: the missing file first, not the missing --tls-key.
        (["--tls-cert", str(tmp_path / "missing.pem")], f"{tmp_path / 'missing.pem'}: no such"),
        (["--expect-ffn", "0"], "--expect-attention and --expect-ffn must be >= 1"),
        (
            ["--expect-ffn", "4", "--expert-parallel-size", "3"],
            "--expert-parallel-size 3 does not divide the 4 FFN ranks",
        ),
        (["--listen", "nowhere"], "--listen must be HOST:PORT or unix:PATH"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "afd_ctl.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr


def publish_raw(
    address: str, metadata: tuple[tuple[str, str], ...], payload: afd_pb2.AFDControlPayload
) -> grpc.RpcError:
    """One payload on a Publish stream of a connection of its own; the error it ends with."""
    with grpc.insecure_channel(address) as channel:
        call = afd_pb2_grpc.AFDControllerStub(channel).Publish(iter([payload]), metadata=metadata)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        return err.value


def test_no_client_can_publish_as_a_worker_it_did_not_register(start_daemon):
    """Issue 10, bug 3: another connection, token in hand, names the attention worker and
    publishes a payload of the current epoch with step 10^12. It is refused, nothing reaches
    the FFN worker, and the real pair's steps keep flowing; after the worker re-registers, its
    old secret is refused too."""
    daemon = start_daemon("--auth-token", TOKEN)
    attn = ControllerClient(daemon.address, WorkerSpec("attn-0", ATTENTION), token=TOKEN)
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN), token=TOKEN)
    try:
        attn.connect(10)
        ffn.connect(10)
        view = attn.wait_complete(10)
        for step in range(1, 6):
            attn.publish(make_payload(step, 1, 1))
        assert [ffn.next_payload(5).step_id for _ in range(5)] == [1, 2, 3, 4, 5]

        forged = make_payload(10**12, 1, 1)
        forged.epoch = view.epoch
        auth = (("authorization", f"Bearer {TOKEN}"), ("afd-worker-id", "attn-0"))
        old_secret = attn.registered.publish_secret
        assert len(old_secret) == 32  # 128 random bits, hex
        for secret, why in (
            (None, "'afd-publish-secret' is missing"),
            ("0" * 32, "is not the one issued to the session of 'attn-0'"),
        ):
            metadata = auth if secret is None else (*auth, ("afd-publish-secret", secret))
            error = publish_raw(daemon.address, metadata, forged)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
            assert why in error.details() and "only the client that registered" in error.details()

        for step in range(6, 11):
            attn.publish(make_payload(step, 1, 1))
        attn.flush()  # no rejection: step 10^12 never counted as the last step
        assert [ffn.next_payload(5).step_id for _ in range(5)] == [6, 7, 8, 9, 10]

        # A new registration gets a new secret; the client moves its stream to it, and the old
        # secret (say, read from a log of the old session) no longer works.
        attn.rejoin("test")
        new = attn.wait_complete(10, after_epoch=view.epoch)
        ffn.wait_complete(10, after_epoch=view.epoch)
        assert attn.registered.publish_secret != old_secret
        forged.epoch = new.epoch
        error = publish_raw(daemon.address, (*auth, ("afd-publish-secret", old_secret)), forged)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
        for step in range(11, 16):
            attn.publish(make_payload(step, 1, 1))
        attn.flush()
        assert [ffn.next_payload(5).step_id for _ in range(5)] == [11, 12, 13, 14, 15]
    finally:
        attn.close()
        ffn.close()
    assert "Traceback" not in daemon.log()


def test_bearer_scheme_is_case_insensitive(start_daemon):
    daemon = start_daemon("--auth-token", TOKEN)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = afd_pb2_grpc.AFDInspectStub(channel)
        for given in (f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer  {TOKEN}"):
            stub.GetStatus(afd_pb2.GetStatusRequest(), metadata=(("authorization", given),))
        for given, why in (
            (f"Bearer {TOKEN.upper()}", "authorization token is wrong"),  # the token is exact
            (f"Basic {TOKEN}", "not a Bearer token"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStatus(afd_pb2.GetStatusRequest(), metadata=(("authorization", given),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert why in err.value.details()


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "serve", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_bad_tls_files_fail_with_one_line_naming_the_file(pki: Path, tmp_path: Path):
    """Issue 10, bug 8: garbage PEM, a key of another certificate, a missing CA file."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text(
        "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n"
    )
    cert, key = str(pki / "server.pem"), str(pki / "server.key")
    for args, message in (
        (["--tls-cert", str(garbage), "--tls-key", key], f"--tls-cert {garbage}: not a PEM"),
        (["--tls-cert", cert, "--tls-key", str(garbage)], f"--tls-key {garbage}: not an"),
        (
            ["--tls-cert", cert, "--tls-key", str(pki / "client.key")],
            f"--tls-key {pki / 'client.key'} is not the private key of --tls-cert {cert}",
        ),
        (
            ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(garbage)],
            f"--tls-client-ca {garbage}: not a PEM certificate",
        ),
    ):
        out = serve(*args)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1

    status = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "status", "--tls-ca", "/missing.pem"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 2, status.stderr
    assert status.stderr.strip() == "afd-ctl status: TLS CA /missing.pem: no such file"


def test_status_into_a_closed_pipe_exits_quietly(start_daemon):
    """`afd-ctl status | head`: the reader is gone before the writer writes (issue 10, bug 8)."""
    daemon = start_daemon()
    proc = subprocess.Popen(
        [sys.executable, "-m", "afd_ctl.cli", "status", "--controller", daemon.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # type: ignore[union-attr]
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 141 and err == "", err


def test_a_tls_mismatch_fails_at_once_naming_the_file(start_daemon, pki: Path, tmp_path: Path):
    """Issue 22, item 6: a handshake that fails is not transient. A CA that did not sign the
    daemon's certificate, a name the certificate does not list, TLS towards a plaintext daemon:
    connect() (given 60 s) and `afd-ctl status` end within seconds with one line naming the
    file or setting and the mismatch."""
    other = tmp_path / "other-ca.pem"
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=other",
        "-keyout", str(tmp_path / "other-ca.key"), "-out", str(other), cwd=tmp_path,
    )  # fmt: skip
    tls_daemon = start_daemon(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")
    )
    plain_daemon = start_daemon()
    ca = str(pki / "ca.pem")
    for address, tls, expected in (
        (
            tls_daemon.address,
            ClientTls(str(other)),
            f"the daemon's certificate must be signed by the CA in {other}",
        ),
        (
            tls_daemon.address,
            ClientTls(ca, server_name="afd.example"),
            "its certificate does not name 'afd.example'",
        ),
        (plain_daemon.address, ClientTls(ca), "it does not speak TLS"),
    ):
        start = time.monotonic()
        with pytest.raises(AfdRejected, match=re.escape(expected)):
            register(address, tls, timeout=60)
        assert time.monotonic() - start < 10
    status = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "status", "--controller", tls_daemon.address,
         "--tls-ca", str(other)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert status.returncode == 1
    # One line of ours (grpc's core may log its own diagnostic line before it).
    last = status.stderr.strip().splitlines()[-1]
    assert f"must be signed by the CA in {other}" in last, status.stderr
    assert "Traceback" not in status.stderr


def test_vllm_start_up_query_fails_at_once_on_a_tls_mismatch(start_daemon, pki: Path):
    """The extension's first call (the expected counts, bounded by connect_timeout_s, 120 s by
    default) gives up at once on a handshake that cannot succeed, naming the CA file."""
    from vllm_ext.control import AfdCredentialsRefused, ControlAccess, expected_counts

    daemon = start_daemon(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")
    )
    wrong_ca = str(pki / "client.pem")  # a certificate, but not the daemon's CA
    start = time.monotonic()
    with pytest.raises(AfdCredentialsRefused, match=re.escape(f"signed by the CA in {wrong_ca}")):
        expected_counts(ControlAccess(daemon.address, ClientTls(wrong_ca)), timeout_s=120)
    assert time.monotonic() - start < 10
    counts = expected_counts(ControlAccess(daemon.address, ClientTls(str(pki / "ca.pem"))), 10)
    assert counts == (1, 1, 1) and counts.ffn_groups == 1
