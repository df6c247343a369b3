"""Bounded polling: spin, then yield the CPU between polls, then sleep between polls.

Without a NIXL progress thread the waiting side must keep calling into NIXL or nothing moves.
Pure spinning starves small hosts (two processes on two cores), and sleeping costs a wake-up
latency on every hop. In between, `sched_yield` keeps polling at full speed while nothing else
wants the core and hands it over at once when something does. Linux's default 50 us timer
slack would turn a 20 us sleep into ~85 us, so the polling thread asks for 1 us slack.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_TIMERSLACK = 29
_tuned = threading.local()


def tighten_timer_slack() -> None:
    """Sets this thread's timer slack to 1 us (Linux only; once per thread, best effort)."""
    if getattr(_tuned, "done", False):
        return
    _tuned.done = True
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0) != 0:
            logger.debug("prctl(PR_SET_TIMERSLACK) failed, errno %d", ctypes.get_errno())
    except OSError:
        logger.debug("prctl unavailable; sleeps keep the default timer slack")


class Backoff:
    """After ``reset()``: spin for ``spin_s``, then yield the CPU on every ``pause()`` until
    ``yield_s`` has passed, then sleep ``sleep_s`` on every ``pause()``."""

    __slots__ = ("spin_s", "yield_s", "sleep_s", "_spin_until", "_yield_until")

    def __init__(self, spin_s: float, sleep_s: float, yield_s: float = 0.0):
        self.spin_s = spin_s
        self.yield_s = yield_s
        self.sleep_s = sleep_s
        self._spin_until = 0.0
        self._yield_until = 0.0

    def reset(self, now: float) -> None:
        self._spin_until = now + self.spin_s
        self._yield_until = self._spin_until + self.yield_s

    def pause(self, now: float) -> None:
        if now < self._spin_until:
            return
        if now < self._yield_until:
            os.sched_yield()
        else:
            time.sleep(self.sleep_s)
