"""Real processes for tests and benchmarks: the afd-ctl daemon and simulated workers.

Each process runs in its own session so teardown can kill its whole group; failures print the
tail of the process log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

LISTEN_RE = re.compile(r"afd-ctl listening on (\S+)")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("AFD_CTL_CONTROLLER", None)
    if extra:
        env.update(extra)
    return env


def afd_ctl(address: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`afd-ctl ARGS --controller ADDRESS` as an operator runs it (its own process), answered
    within `timeout` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", *args, "--controller", address],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


# Every Proc not yet stopped (stop_children_on_sigterm stops them).
_LIVE: weakref.WeakSet[Proc] = weakref.WeakSet()


def stop_children_on_sigterm() -> None:
    """For a script that starts Procs: SIGTERM (`timeout`, a cancelled job) stops them too.
    Each Proc runs in its own session, so without this they outlive the script (and a GPU
    server keeps its memory). Stops every live Proc, then exits 128 + SIGTERM."""

    def stop_all(signum: int, _frame: object) -> None:
        for proc in list(_LIVE):
            proc.stop()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop_all)


class Proc:
    """A child process whose output goes to a log file."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        stdin_pipe: bool = False,
        cwd: Path | None = None,
    ) -> None:
        """`stdin_pipe`: the caller writes to the child's stdin (`send`); `cwd`: where it runs
        (default: here)."""
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            env=child_env(env),
            start_new_session=True,
            text=stdin_pipe,
            cwd=cwd,
        )
        _LIVE.add(self)

    def send(self, line: str) -> None:
        """One line to the child's stdin (started with stdin_pipe)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(line.rstrip("\n") + "\n")
        self.popen.stdin.flush()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.argv[2:5]} still running after {timeout} s; log tail:\n{self.tail()}"
            ) from None

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(10)
        self._log.close()
        _LIVE.discard(self)

    def json_report(self, timeout: float) -> dict:
        """The JSON object the process prints as its report (it may still be running)."""
        return json.loads(self.wait_for(r"(?m)^\{.*\}$", timeout).group(0))

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            match = regex.search(self.log())
            if match:
                return match
            if self.popen.poll() is not None:
                match = regex.search(self.log())
                if match:
                    return match
                raise AssertionError(
                    f"process exited ({self.popen.returncode}) before {pattern!r}:\n{self.tail()}"
                )
            time.sleep(0.02)
        raise AssertionError(f"{pattern!r} not seen within {timeout} s; log tail:\n{self.tail()}")


class Daemon(Proc):
    """`afd-ctl serve` on a kernel-chosen port (or the given --listen)."""

    def __init__(
        self,
        log_path: Path,
        *args: str,
        listen: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
        timeout: float = 20.0,
        cwd: Path | None = None,
    ) -> None:
        argv = [sys.executable, "-m", "afd_ctl.cli", "serve", "--listen", listen, *args]
        super().__init__(argv, log_path, env, cwd=cwd)
        self.address = self.wait_for(LISTEN_RE.pattern, timeout).group(1)


def sim_worker(log_path: Path, controller: str, role: str, *args: str, **env: str) -> Proc:
    argv = [sys.executable, "-m", "afd_ctl.sim_worker", "--controller", controller, "--role", role]
    return Proc([*argv, *args], log_path, env or None)
