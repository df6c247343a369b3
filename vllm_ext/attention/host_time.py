"""What AFD itself costs the attention host per step: the time vLLM's runner thread spends in
the step machine's calls (opening the step, publishing its payload, closing it), apart from
vLLM's own work.

Where the host does not run ahead of its GPU (short steps: few layers, or large batches whose
CPU work is long) every microsecond here lengthens the step, so `afd_stats` carries the medians
of the last WINDOW steps and their sum (`afd_host_us_per_step_median`); benchmarks/e2e_decode.py
puts them beside the TPOT they explain. Two perf_counter reads per part and step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

WINDOW = 1000
# "open" is the whole of open_step, its "publish" included; "connect" (the exchange to run on),
# "begin" (the exchange's begin_step) and "retired" (steps that ran to their end, reported)
# are parts of "open" too, apart from "publish". "direct" is the part of "publish" that sends
# the direct copies (afd_ctl.direct); "enqueue" (the exchange's end_step) and "closed" (the
# session's bookkeeping: metrics, fence) are parts of "close".
PARTS = ("open", "publish", "close", "connect", "begin", "retired", "direct", "enqueue", "closed")
# Besides: the runner thread's CPU time in open and close (`cpu`, time.thread_time): where the
# wall time of the parts is well above it, they wait (the interpreter lock, a lock, the OS).


class HostTime:
    def __init__(self) -> None:
        self._step = dict.fromkeys(PARTS, 0.0)
        self._recent: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
        self._cpu = 0.0  # the step's CPU time so far
        self._cpu_from = 0.0
        self._cpu_recent: deque[float] = deque(maxlen=WINDOW)

    def cpu_from(self) -> None:
        """The runner's CPU time counts from now (open or close begins)."""
        self._cpu_from = time.thread_time()

    def cpu_to(self) -> None:
        """... until now (open or close ends)."""
        self._cpu += time.thread_time() - self._cpu_from

    def start(self) -> float:
        """A part begins; pass what this returns to `add`."""
        return time.perf_counter()

    def add(self, part: str, started: float) -> float:
        """Adds the part's time since `started`; returns now (the next part's start)."""
        now = time.perf_counter()
        self._step[part] += now - started
        return now

    def step_done(self) -> None:
        """The step closed: its parts join the window (in PARTS order: the dict's own)."""
        self._recent.append(tuple(self._step.values()))
        self._step = dict.fromkeys(PARTS, 0.0)
        self._cpu_recent.append(self._cpu)
        self._cpu = 0.0

    def stats(self) -> dict[str, float]:
        """Medians over the window, µs: "open" without its "publish", its own parts, "close",
        and the step's sum."""
        if not self._recent:
            return {}
        opens, publishes, closes, *inner = zip(*self._recent, strict=True)
        within = {"direct": "publish", "enqueue": "close", "closed": "close"}
        parts = {
            "open": [o - p for o, p in zip(opens, publishes, strict=True)],
            "publish": publishes,
            "close": closes,
            **{
                f"{within.get(name, 'open')}_{name}": values
                for name, values in zip(PARTS[3:], inner, strict=True)
            },
        }
        out = {
            f"afd_host_us_{part}_median": round(1e6 * statistics.median(values), 1)
            for part, values in parts.items()
        }
        totals = [o + c for o, c in zip(opens, closes, strict=True)]
        out["afd_host_us_per_step_median"] = round(1e6 * statistics.median(totals), 1)
        if self._cpu_recent:
            cpu = statistics.median(self._cpu_recent)
            out["afd_host_cpu_us_per_step_median"] = round(1e6 * cpu, 1)
        return out
