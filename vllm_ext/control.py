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

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from afd_ctl.channel import (
    CLOSED_IN_HANDSHAKE_STRIKES,
    ClientTls,
    auth_metadata,
    open_channel,
    tls_problem,
)

if TYPE_CHECKING:
    from afd_ctl.client import ControllerClient, WorkerSpec
    from afd_ctl.v1 import afd_pb2
    from vllm_ext.config import AfdConfig

TOKEN_ENV = "AFD_CTL_AUTH_TOKEN"
# Refusals that no retry fixes: the credentials are wrong.
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


# While afd-ctl does not answer at start-up: say so at once, then this often.
UNANSWERED_LOG_S = 10.0

log = logging.getLogger(__name__)


class ExpectedCounts(NamedTuple):
    """What afd-ctl expects: M attention ranks, N FFN ranks, and the number of FFN groups its
    routing uses (afd_ctl.routing; N / --expert-parallel-size, or min(M, N))."""

    num_attention: int
    num_ffn: int
    ffn_groups: int


class AfdCredentialsRefused(RuntimeError):
    """afd-ctl refused this worker's token or certificate; a setting must change."""


@dataclass(frozen=True)
class ControlAccess:
    """Address, TLS and token of afd-ctl, as one worker reaches it."""

    controller: str
    tls: ClientTls | None = None
    token: str = field(default="", repr=False)  # never in a repr, so never in a log line
    # At start-up: connection refused (or a name that does not resolve) on every try this
    # long ends the wait for afd-ctl before connect_timeout_s (`expected_counts`).
    refused_timeout_s: float = 5.0
    # Step payloads also straight between the sender and its FFN workers on this host (afd
    # direct_payloads: "auto" on the GPU-driven path, "on", "off").
    direct_payloads: str = "off"
    # How long the sender's copies to afd-ctl may wait for the next (afd publish_coalesce_s).
    publish_coalesce_s: float = 0.0

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
        token = _token(afd.auth_token_file)
        return cls(
            afd.controller,
            tls,
            token,
            afd.refused_timeout_s,
            afd.direct_payloads,
            afd.publish_coalesce_s,
        )

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

    def tls_refused(self, exc: grpc.RpcError, strikes: int) -> AfdCredentialsRefused | None:
        """The error to raise when `exc` says the TLS settings do not fit the daemon (at once
        when certain, after CLOSED_IN_HANDSHAKE_STRIKES in a row when the daemon only closed
        the connection); else None."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        problem = tls_problem(exc.details() or "", self.controller, self.tls)
        if problem is None or not (problem[1] or strikes >= CLOSED_IN_HANDSHAKE_STRIKES):
            return None
        return AfdCredentialsRefused(problem[0])


class StatusQuery:
    """GetStatus on one reused channel (the API server asks every /health)."""

    def __init__(self, access: ControlAccess) -> None:
        self.access = access
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def get(self, timeout_s: float) -> afd_pb2.Status:
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


def expected_counts(
    access: ControlAccess,
    timeout_s: float,
    *,
    ffn_rank: int | None = None,
    attention_rank: int | None = None,
) -> ExpectedCounts:
    """(attention ranks M, FFN ranks N, FFN groups) the daemon expects, waiting for it to
    answer; wrong credentials fail at once (AfdCredentialsRefused), saying so. An FFN rank
    (`ffn_rank`) or attention rank (`attention_rank`) outside the current membership while an
    `afd-ctl scale` is in progress joins its target: the target's counts (issue 37)."""
    from afd_ctl.v1 import afd_pb2

    started = time.monotonic()
    deadline = started + timeout_s
    next_log = started  # the first failure is said at once, then every UNANSWERED_LOG_S
    query = StatusQuery(access)
    controller = access.describe()
    strikes = 0  # handshakes in a row the daemon closed
    nobody = NobodyThere(access)
    try:
        while True:
            try:
                status = query.get(timeout_s=5)
                break
            except grpc.RpcError as exc:
                strikes = strikes + 1 if "Socket closed" in (exc.details() or "") else 0
                refused = access.tls_refused(exc, strikes)
                if refused is not None:
                    raise refused from None
                nobody.check(exc)
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(
                        f"afd-ctl at {controller} did not answer within {timeout_s:.0f} s "
                        f"({exc.code().name}: {exc.details()}); is `afd-ctl serve` running "
                        "there, with the TLS settings this worker has?"
                    ) from None
                if now >= next_log:
                    if next_log == started:
                        log.warning(
                            "afd: afd-ctl at %s does not answer (%s); is `afd-ctl serve` running "
                            "there? Retrying for up to %.0f s (afd connect_timeout_s)",
                            controller,
                            exc.code().name,
                            timeout_s,
                        )
                    else:
                        log.warning(
                            "afd: afd-ctl at %s still does not answer after %.0f s (%s); "
                            "retrying for another %.0f s",
                            controller,
                            now - started,
                            exc.code().name,
                            deadline - now,
                        )
                    next_log = now + UNANSWERED_LOG_S
                time.sleep(0.5)
    finally:
        query.close()
    counts = {r.role: r.expected for r in status.roles}
    m, n = counts[afd_pb2.ATTENTION], counts[afd_pb2.FFN]
    joining = [
        (label, rank)
        for label, rank, count in (("ffn", ffn_rank, n), ("attention", attention_rank, m))
        if rank is not None and rank >= count
    ]
    if joining and status.HasField("change"):
        target = status.change.target
        log.info(
            "afd: %s rank %d joins afd-ctl's target %d:%d (%d FFN group(s))",
            *joining[0],
            target.attention,
            target.ffn,
            target.ffn_groups,
        )
        return ExpectedCounts(target.attention, target.ffn, target.ffn_groups)
    # 0: a daemon older than the field, which routes with min(M, N) groups.
    return ExpectedCounts(m, n, status.ffn_groups or min(m, n))


class NobodyThere:
    """Tells "nothing listens at ADDR" (connection refused on every try) and "ADDR does not
    resolve" from a host that does not answer: the first two are certain within seconds
    (access.refused_timeout_s), the last only after connect_timeout_s."""

    # What grpc's message says -> what it means (grpc's resolvers word DNS failures apart).
    REFUSED = (
        "nothing listens at {addr}: connection refused on every try for {s:.0f} s; start "
        "`afd-ctl serve` there (its --listen on that port) or fix --afd-controller"
    )
    NO_NAME = (
        "{host} does not resolve (DNS) on every try for {s:.0f} s; check the host in "
        "--afd-controller {addr}"
    )
    SIGNS = {
        "Connection refused": REFUSED,
        "DNS resolution failed": NO_NAME,
        "errors resolving": NO_NAME,
    }

    def __init__(self, access: ControlAccess) -> None:
        self.access = access
        self.since: float | None = None
        self.sign = ""

    def check(self, exc: grpc.RpcError) -> None:
        """Raises TimeoutError once the same sign has held for refused_timeout_s."""
        details = exc.details() or ""
        sign = next((self.SIGNS[s] for s in self.SIGNS if s in details), "")
        now = time.monotonic()
        if not sign or sign != self.sign:
            self.since, self.sign = (now if sign else None), sign
            return
        assert self.since is not None
        if now - self.since < self.access.refused_timeout_s:
            return
        addr = self.access.controller
        host = addr.rpartition(":")[0] or addr
        raise TimeoutError(
            "afd-ctl: "
            + sign.format(addr=addr, host=host, s=now - self.since)
            + " (afd refused_timeout_s; a host that does not answer is waited for up to "
            "connect_timeout_s)"
        )


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
