"""What a failing AFD step writes to the attention server's log: one line per step, a traceback
once per cause and then at most once a minute.

While the FFN side is down every request fails at once, and vLLM logs each failed step twice
over besides our one line (`step_failures.fail_running_requests`): the worker process logs the
exception with its traceback ("WorkerProc hit an exception.", about 20 lines), and the engine
core dumps the whole engine config and scheduler output ("Dumping input data ...", several KB).
That was 344 MB in 5 minutes of a stranded server (issue 22). Filters on those two vLLM
loggers keep the first of each, per cause, and then one a minute with a count of those dropped.
They only drop records about an AFD step failure (or an engine dump right after one), so vLLM
without AFD logs exactly as before.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from vllm_ext.attention.step_failures import MARK

# vLLM's loggers (vllm/v1/executor/multiproc_executor.py `WorkerProc`, and
# vllm/logging_utils/dump_input.py `dump_engine_exception`; the same names on 0.26 and 0.32).
WORKER_LOGGER = "vllm.v1.executor.multiproc_executor"
DUMP_LOGGER = "vllm.logging_utils.dump_input"
# Our own one line per failed step (step_failures.fail_running_requests), which arms the
# dump filter of its process.
STEP_LOGGER = "vllm_ext.attention.step_failures"
REPEAT_INTERVAL_S = 60.0
# The three records of one engine dump come within this long of each other.
DUMP_BURST_S = 1.0
_NUMBERS = re.compile(r"\d+")


def cause_of(text: str) -> str:
    """A failure's cause, as a key: its first line from the AFD mark on, numbers (steps,
    layers, epochs, ports) left out, so that each step of one outage is the same cause."""
    start = text.find(MARK)
    line = (text[start:] if start >= 0 else text).strip().splitlines()
    return _NUMBERS.sub("#", line[0] if line else "")[:300]


def _failure_text(record: logging.LogRecord) -> str | None:
    """The AFD step failure a record is about, if it is about one."""
    if record.exc_info and record.exc_info[1] is not None:
        text = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        if MARK in text:
            return text
    message = record.getMessage()
    return message if MARK in message else None


class RepeatFilter(logging.Filter):
    """Passes the first record of each cause, then one record a minute (with a note of how
    many were dropped); records not about an AFD failure always pass."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._causes: set[str] = set()
        self._last = -interval_s
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        text = _failure_text(record)
        if text is None:
            return True
        cause = cause_of(text)
        now = time.monotonic()
        with self._lock:
            if cause not in self._causes or now - self._last >= self.interval_s:
                if len(self._causes) < 1000:
                    self._causes.add(cause)
                if self.dropped:
                    record.msg = f"{record.msg} ({self.dropped} more like it not logged)"
                self._last, self.dropped = now, 0
                return True
            self.dropped += 1
            return False


class DumpFilter(logging.Filter):
    """vLLM's engine dump after an AFD step failure: the first one in a minute passes (all of
    its records), later ones are dropped. Armed by our own failure line (`arm`)."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._armed_at: float | None = None
        self._shown_at = -interval_s
        self.dropped = 0

    def arm(self) -> None:
        self._armed_at = time.monotonic()

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._shown_at <= DUMP_BURST_S:
            return True  # the rest of a dump that was let through
        armed = self._armed_at is not None and now - self._armed_at <= self.interval_s
        if not armed or now - self._shown_at >= self.interval_s:
            self._shown_at = now  # no AFD failure lately (vLLM's dump as it is), or a minute on
            return True
        self.dropped += 1
        return False


class _Arming(logging.Filter):
    def __init__(self, dump: DumpFilter) -> None:
        super().__init__()
        self._dump = dump

    def filter(self, record: logging.LogRecord) -> bool:
        if MARK in record.getMessage():
            self._dump.arm()
        return True


_installed = False


def install() -> None:
    """Adds the filters in this process (idempotent; every vLLM process calls register())."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger(WORKER_LOGGER).addFilter(RepeatFilter())
    dump = DumpFilter()
    logging.getLogger(DUMP_LOGGER).addFilter(dump)
    logging.getLogger(STEP_LOGGER).addFilter(_Arming(dump))
