"""A timeline of GPU-driven steps on both sides, for finding where a step's time goes.

Off unless `AFD_TIMELINE_DIR` names a folder: then each worker writes one JSON line per step
that ran to its end (`<role>-<rank>-<pid>.jsonl`): its step id and rows, the host's stamps
(`host_open`: the attention side opened the step / the FFN side began to run its payload;
`host_control`: the attention side published its payload / the FFN side took it;
`host_enqueued`: its last GPU operation was enqueued or its graph launched) and its GPU span
(`gpu_start`, `gpu_end`: its first and last event, placed on the host's clock), all in seconds
of `time.monotonic()`, which every process of a host shares. benchmarks/timeline.py joins the
two sides' files.

GPU times are placed on the host's clock by anchors (`GpuClock`): an event recorded on a
stream of its own, whose completion the host sees within microseconds; an anchor older than
`REANCHOR_S` is renewed (so clock drift stays far below a step), never with a sync of the
compute stream. Lines are written when the host reports retired steps (between steps), at most
`MAX_LINES` per worker; with `AFD_TIMELINE_EVERY=N` only for steps k, k+1 and k+2 of every N
(benchmarks/e2e_interleaved.py: 8, so that the timeline costs AFD's timed steps little). An
attention line also carries `host_tokens`: when the step's verdict was asked, right after vLLM's
own wait for its sampled tokens (0.0 for a step whose verdict nobody asked).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from vllm_ext.exchange.gpu_events import CudaEvent

if TYPE_CHECKING:
    from vllm_ext.exchange.gpu_watchdog import Retired

ENV = "AFD_TIMELINE_DIR"
# Only steps k, k+1 and k+2 of every EVERY_ENV steps (k a multiple): each line costs the host's
# step tens of microseconds on the H200 host, which a benchmark times; the two after a step
# give its period, its idle time and when the host opened the step after next.
EVERY_ENV = "AFD_TIMELINE_EVERY"
SAMPLED = 3  # of every EVERY steps, the first three
# Attention lines waiting for their step's verdict (or verdicts for their line), at most.
MAX_WAITING = 64
MAX_LINES = 200_000
REANCHOR_S = 5.0


class GpuClock:
    """Maps a CUDA timing event (vllm_ext.exchange.gpu_events) to the host's monotonic clock."""

    def __init__(self) -> None:
        from afd_data.cuda_driver import driver

        self._cuda = driver()
        self._stream = self._cuda.non_blocking_stream()
        self._event: CudaEvent | None = None
        self._host = 0.0

    def _anchor(self) -> None:
        event = CudaEvent(self._cuda)
        before = time.monotonic()
        event.record(self._stream)
        deadline = before + 0.05
        while not event.query():  # a stream of its own: nothing runs before it
            if time.monotonic() > deadline:
                return  # the device is saturated with other work: keep the old anchor
        after = time.monotonic()
        self._event, self._host = event, (before + after) / 2

    def host_time(self, event: CudaEvent) -> float | None:
        """When `event` (a completed timing CUDA event) happened, in host monotonic seconds;
        None while no anchor could be taken (the device never idled enough)."""
        if self._event is None or time.monotonic() - self._host > REANCHOR_S:
            self._anchor()
        if self._event is None:
            return None
        return self._host + self._event.elapsed_s(event)


class Timeline:
    """One worker's timeline file, or nothing when AFD_TIMELINE_DIR is unset. `verdicts` (the
    attention side): each line waits for its step's verdict, whose time it carries as
    `host_tokens` (vLLM's wait for the step's sampled tokens had just ended)."""

    def __init__(self, role: str, rank: int, verdicts: bool = False) -> None:
        folder = os.environ.get(ENV, "")
        self._file: IO[str] | None = None
        self._lines = 0
        self._every = max(1, int(os.environ.get(EVERY_ENV, "1") or 1))
        self._verdicts = verdicts
        self._waiting: dict[int, str] = {}  # step id -> its line without host_tokens
        self._tokens_at: dict[int, float] = {}  # step id -> its verdict, line not yet there
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            path = Path(folder) / f"{role}-{rank}-{os.getpid()}.jsonl"
            self._file = path.open("a", buffering=1 << 16)
            self._clock = GpuClock()

    @property
    def on(self) -> bool:
        return self._file is not None

    def _sampled(self, step_id: int) -> bool:
        """A line for this step is wanted (the file is open, not full, and the step sampled):
        checked before any GPU time is read or a line formatted."""
        if self._file is None or self._lines >= MAX_LINES:
            return False
        return self._every == 1 or step_id % self._every < SAMPLED

    def step(self, retired: Retired) -> None:
        """One step that ran to its end (its events have passed)."""
        start: Any = retired.start  # vllm_ext.exchange.gpu_events.CudaEvent
        end: Any = retired.end
        if not self._sampled(retired.step_id) or start is None or end is None:
            return
        gpu_start, gpu_end = self._clock.host_time(start), self._clock.host_time(end)
        if gpu_start is None or gpu_end is None:
            return
        # Formatted by hand: json.dumps of the dict cost about three times as much, on the
        # host's path of every step the benchmark times (its colocated part has no timeline).
        line = (
            f'{{"step": {retired.step_id}, "rows": {retired.tokens}, '
            f'"host_open": {retired.enqueued_at - retired.host_s:.7f}, '
            f'"host_enqueued": {retired.enqueued_at:.7f}, '
            f'"host_control": {retired.control_at:.7f}, '
            f'"gpu_start": {gpu_start:.7f}, "gpu_end": {gpu_end:.7f}'
        )
        if not self._verdicts:
            self._write(line)
        elif retired.step_id in self._tokens_at:
            self._write(line, self._tokens_at.pop(retired.step_id))
        else:
            self._waiting[retired.step_id] = line
            while len(self._waiting) > MAX_WAITING:  # a step nobody asked the verdict of
                self._write(self._waiting.pop(next(iter(self._waiting))))

    def tokens(self, step_id: int, at: float) -> None:
        """The verdict of `step_id` was asked at `at` (monotonic): right after vLLM's own wait
        for the step's sampled tokens."""
        if not self._sampled(step_id):
            return
        line = self._waiting.pop(step_id, None)
        if line is not None:
            self._write(line, at)
            return
        self._tokens_at[step_id] = at
        while len(self._tokens_at) > MAX_WAITING:
            self._tokens_at.pop(next(iter(self._tokens_at)))

    def _write(self, line: str, tokens_at: float = 0.0) -> None:
        assert self._file is not None
        if self._lines < MAX_LINES:
            self._file.write(f'{line}, "host_tokens": {tokens_at:.7f}}}\n')
            self._lines += 1

    def close(self) -> None:
        if self._file is not None:
            for line in self._waiting.values():
                self._write(line)
            self._waiting.clear()
            self._file.close()
            self._file = None
