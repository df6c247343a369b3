"""The timing CUDA events of GPU-driven steps: one at each step's start and end on each side,
which the watchdog (vllm_ext.exchange.gpu_watchdog) queries to retire a step and reads for its
GPU time, without a sync."""

from __future__ import annotations

from typing import Any

import torch


class CudaEvent:
    """A timing CUDA event as the watchdog reads it."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> CudaEvent:
        self.event.record()
        return self

    def query(self) -> bool:
        return bool(self.event.query())

    def elapsed_s(self, end: Any) -> float:
        return float(self.event.elapsed_time(end.event)) / 1e3


class EventPool:
    """Timing events of retired steps, recorded again for new ones: a new torch.cuda.Event per
    step and side creates (and, once dropped, destroys) a CUDA event, driver calls on the
    host's path that MPS makes dearer. One host thread takes and gives back."""

    def __init__(self, keep: int = 64) -> None:
        self._free: list[CudaEvent] = []
        self._keep = keep

    def recorded(self) -> CudaEvent:
        """An event recorded now on the current stream."""
        return (self._free.pop() if self._free else CudaEvent()).record()

    def give_back(self, *events: Any) -> None:
        """Events of a step that ran to its end, read for the last time."""
        for event in events:
            if isinstance(event, CudaEvent) and len(self._free) < self._keep:
                self._free.append(event)
