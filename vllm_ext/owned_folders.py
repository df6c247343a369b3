"""Temporary folders owned by one process, which reclaim those of processes gone."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def owned_temp_folder(prefix: str) -> str:
    """A new folder owned by this process (vllm_ext.metrics: its Prometheus series files),
    `<prefix><pid namespace>.<pid>-<random>` in the temporary folder, removed at exit. A process
    killed with -9 (or by its supervisor) runs no exit handler, so first the folders of the same
    prefix whose owner is gone are removed: they pile up no further than the processes alive.
    Only owners in this process's PID namespace are judged (a /tmp shared between containers
    holds pids this process cannot see)."""
    here = _pid_namespace()
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{prefix}{here}.*-*"):
        pid = folder.name[len(f"{prefix}{here}.") :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    directory = tempfile.mkdtemp(prefix=f"{prefix}{here}.{os.getpid()}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _pid_namespace() -> str:
    """The inode of this process's PID namespace ('pid:[4026531836]' -> '4026531836'), or
    'pid' where /proc does not say (not Linux)."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return "pid"
    return "".join(c for c in link if c.isdigit()) or "pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
