"""A benchmark or GPU-check script ended with SIGTERM (`timeout`, a cancelled job) stops the
servers it started: they run in their own sessions, so otherwise they outlive it (on a GPU,
holding its memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.procs import Proc, stop_children_on_sigterm

    stop_children_on_sigterm()
    child = Proc([sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[1]))
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_children_a_script_started(tmp_path: Path) -> None:
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "child.log")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert script.stdout is not None
        child = int(script.stdout.readline())
        assert _alive(child)
        script.send_signal(signal.SIGTERM)
        assert script.wait(30) == 128 + signal.SIGTERM
        assert not _alive(child), "the script's child outlived it"
    finally:
        script.kill()
