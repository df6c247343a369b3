"""Temporary folders owned by one process, which reclaim those of processes gone."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def owned_temp_folder(prefix: str) -> str:
    """A new folder owned by this process (vllm_ext.metrics: its Prometheus series files),
    `<prefix><pid>-<random>` in the temporary folder, removed at exit. A process killed with -9 (or by its supervisor) runs no exit
    handler, so first the folders of the same prefix whose owning process is gone are removed:
    they pile up no further than the processes alive."""
    root = Path(tempfile.gettempdir())
    for stale in root.glob(f"{prefix}*-*"):
        pid = stale.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    directory = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
