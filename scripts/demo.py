"""`make demo-sim`: the control plane end to end on this machine, without vLLM.

Starts `afd-ctl serve`, one simulated attention worker and two simulated FFN workers, each in
its own process; runs a few hundred steps through the daemon; prints `afd-ctl status`; then
stops everything cleanly (SIGTERM drains the daemon, which exits 0). Its temporary folder (the
daemon's log) is removed on exit, also on failure; a failure prints the log first.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 300
EPOCH_NOTE = (
    "(the epoch starts at the daemon's start time in wall-clock milliseconds and goes up by "
    "one per membership change)"
)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="afd-demo-") as tmp:
        return run(Path(tmp))


def run(tmp: Path) -> int:
    python = sys.executable
    log = open(tmp / "daemon.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [python, "-m", "afd_ctl.cli", "serve", "--listen", "127.0.0.1:0",
         "--expect-attention", "1", "--expect-ffn", "2"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    workers: list[subprocess.Popen] = []
    try:
        address = wait_for_listen(tmp / "daemon.log", daemon)
        print(f"afd-ctl serving on {address}")
        common = ["--controller", address, "--steps", str(STEPS), "--timeout", "30"]
        for rank in range(2):
            workers.append(spawn(python, "ffn", "--dp-rank", str(rank), "--dp-size", "2",
                                 *common, "--hold-s", "30"))  # fmt: skip
        attention = spawn(python, "attention", *common, "--rate", "200", "--hold-s", "30")
        workers.append(attention)
        print(f"running {STEPS} steps: 1 attention -> afd-ctl -> 2 FFN workers ...")
        reports = [read_report(w) for w in workers]
        for report in reports:
            print("  " + json.dumps({k: v for k, v in report.items() if k != "epoch"}))
        ok = all(not r.get("problems") and not r.get("error") for r in reports)
        ok = ok and all(r.get("received") == STEPS for r in reports if r.get("role") == "ffn")
        print()
        subprocess.run([python, "-m", "afd_ctl.cli", "status", "--controller", address], check=True)
        print(EPOCH_NOTE)
        print()
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(15)
        for worker in workers:
            worker.wait(15)
        print(f"daemon drained and exited with {code}; workers stopped")
        print("demo " + ("OK" if ok and code == 0 else "FAILED"))
        if not (ok and code == 0):
            print(f"--- afd-ctl log ---\n{(tmp / 'daemon.log').read_text()}", file=sys.stderr)
        return 0 if ok and code == 0 else 1
    finally:
        for proc in (*workers, daemon):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        log.close()


def spawn(python: str, role: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [python, "-m", "afd_ctl.sim_worker", "--role", role, *args],
        stdout=subprocess.PIPE,
        text=True,
    )


def read_report(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        return {"error": f"worker exited with {proc.wait()} before reporting"}
    return json.loads(line)


def wait_for_listen(path: Path, daemon: subprocess.Popen) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = path.read_text()
        if "listening on " in text:
            return text.split("listening on ")[1].split()[0]
        if daemon.poll() is not None:
            raise SystemExit(f"afd-ctl exited:\n{text}")
        time.sleep(0.05)
    raise SystemExit("afd-ctl did not start within 30 s")


if __name__ == "__main__":
    sys.exit(main())
