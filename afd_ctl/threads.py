"""AFD's threads, named for the OS as well as for Python, so that `top -H`, `ps -L`, perf and
/proc/PID/task/TID/comm tell an operator which of a worker's threads costs what (CPython names
a thread only for itself: the OS sees every thread under the process's name). Linux only;
elsewhere the OS name is left alone."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

PR_SET_NAME = 15  # prctl(2): the calling thread's name, 16 bytes with its NUL
OS_NAME_BYTES = 15
_prctl: Any = None


def name_os_thread(name: str) -> None:
    """Gives the calling thread `name` (its first 15 bytes) as its OS name."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return
    try:
        if _prctl is None:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl(PR_SET_NAME, name.encode()[:OS_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the name is only cosmetic
        pass


def named_thread(
    target: Callable[..., object],
    name: str,
    args: tuple[Any, ...] = (),
    os_name: str = "",
) -> threading.Thread:
    """A daemon thread (not started) called `name` in Python and, once it runs, `os_name` (15
    bytes at most; default `name`'s first 15) for the OS."""

    def run() -> None:
        name_os_thread(os_name or name)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
