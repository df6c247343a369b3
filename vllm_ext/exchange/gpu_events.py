"""The timing CUDA events of GPU-driven steps: one at each step's start and end on each side,
which the watchdog (vllm_ext.exchange.gpu_watchdog) queries to retire a step and reads for its
GPU time, without a sync.

Through the driver (afd_data.cuda_driver), not torch.cuda.Event: on the H200 host a step's two
torch records cost the attention host about 40 µs each (torch builds a Stream object for the
current stream per call, then records), in a step the host paces whenever it does not run
ahead of its GPU. Events are created once and recorded again (`EventPool`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def current_stream_of(device: torch.device) -> Callable[[], int]:
    """A cheap reader of the current CUDA stream's handle on `device` (the stream vLLM runs
    the step on: its FULL graphs replay there)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: int(raw(index))
    return lambda: int(torch.cuda.current_stream(index).cuda_stream)


class CudaEvent:
    """A timing CUDA event as the watchdog reads it (`cuda`: afd_data.cuda_driver's driver)."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        self.handle = cuda.event_create()

    def record(self, stream: int) -> CudaEvent:
        self._cuda.event_record(self.handle, stream)
        return self

    def query(self) -> bool:
        return bool(self._cuda.event_done(self.handle))

    def elapsed_s(self, end: Any) -> float:
        return float(self._cuda.event_elapsed_ms(self.handle, end.handle)) / 1e3

    def __del__(self) -> None:
        try:
            self._cuda.event_destroy(self.handle)
        except Exception:  # interpreter or context shutting down
            pass


class EventPool:
    """Timing events of retired steps, recorded again for new ones: creating (and destroying)
    a CUDA event per step and side would be driver calls on the host's path. One host thread
    takes and gives back."""

    def __init__(self, cuda: Any, stream: Callable[[], int], keep: int = 64) -> None:
        self._cuda = cuda
        self._stream = stream
        self._free: list[CudaEvent] = []
        self._keep = keep

    def recorded(self) -> CudaEvent:
        """An event recorded now on the current stream."""
        event = self._free.pop() if self._free else CudaEvent(self._cuda)
        return event.record(self._stream())

    def give_back(self, *events: Any) -> None:
        """Events of a step that ran to its end, read for the last time."""
        for event in events:
            if isinstance(event, CudaEvent) and len(self._free) < self._keep:
                self._free.append(event)
