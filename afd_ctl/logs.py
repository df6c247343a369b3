"""What the daemon writes about a client's input: bounded in size and in rate.

A client controls worker ids, leave reasons and request bytes; none of them may make one log
line (or one error message) huge, or make the log grow as fast as the client can send.
"""

from __future__ import annotations

import logging
import re
import time

# What logs and error messages quote of a client's text (worker ids, metadata) is cut to this.
QUOTE_CHARS = 200
# Characters that would let a client's text start a new log line or hide part of one: C0 and
# C1 controls, line and paragraph separators, bidirectional overrides and isolates.
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape(text: str) -> str:
    """`text` with every character of UNPRINTABLE written as its escape (a newline as `\\n`),
    so a client's text never forges or hides a log line."""
    return UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` escaped, cut to its first `limit` characters plus how long it was."""
    if len(text) <= limit:
        return escape(text)
    return f"{escape(text[:limit])}...({len(text)} chars)"


class RateLimitedLog:
    """One warning per interval for a repeating problem, with the count of those not shown."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 1.0) -> None:
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self._last = -interval_s
        self._suppressed = 0

    def warn(self, detail: str) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" (and {self._suppressed} more)" if self._suppressed else ""
        self.logger.warning("%s%s: %s", self.what, more, detail)
        self._last, self._suppressed = now, 0
