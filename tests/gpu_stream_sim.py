"""A simulated GPU for the GPU-driven exchange's host side: one attention stream and one FFN
stream, each a thread that executes the operation lists of afd_data.gpu_protocol in order, as
a CUDA stream does (a Wait spins until its flag is set, nothing else waits), with step events
recorded between them. The watchdog (vllm_ext.exchange.gpu_watchdog) polls those events and
poisons the attention stream's flags exactly as it poisons the real ones.

CI has no GPU: this drives the real watchdog, verdicts and step timings against a stream that
progresses by itself, stalls when the FFN side dies, and is released by poison.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from afd_data.gpu_protocol import (
    POISON,
    AttentionPeer,
    Compute,
    FlagLayout,
    Loc,
    Wait,
    Write,
    attention_ops,
    ffn_ops,
    met,
)


class SimEvent:
    """A CUDA event on a simulated stream: done once the stream has run past it."""

    def __init__(self) -> None:
        self.done_at: float | None = None

    def query(self) -> bool:
        return self.done_at is not None

    def elapsed_s(self, end: Any) -> float:
        assert self.done_at is not None and end.done_at is not None
        return end.done_at - self.done_at


class SimStream(threading.Thread):
    """Runs queued items in order: ("op", op) or ("event", SimEvent) or ("compute", seconds)."""

    def __init__(self, gpu: SimGpu, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.gpu = gpu
        self.queue: deque[tuple[str, Any]] = deque()
        self.dead = False
        self.stopped = False

    def run(self) -> None:
        while not self.stopped:
            if self.dead or not self.queue:
                time.sleep(50e-6)
                continue
            kind, item = self.queue[0]
            if kind == "op" and isinstance(item, Wait):
                if not met(self.gpu.flags.get(_key(item.flag), 0), item):
                    time.sleep(20e-6)
                    continue
            elif kind == "op" and isinstance(item, Write):
                self.gpu.flags[_key(item.flag)] = item.value
            elif kind == "compute":
                time.sleep(item)
            elif kind == "event":
                item.done_at = time.monotonic()
            self.queue.popleft()


def _key(loc: Loc) -> tuple[Any, ...]:
    return (loc.owner, loc.rank, loc.area, loc.index)


class SimGpu:
    """One attention rank and one FFN rank, `layers` layers, one stage, one slot per stage."""

    def __init__(self, layers: int = 4, ffn_compute_s: float = 0.0005) -> None:
        self.layers = layers
        self.ffn_compute_s = ffn_compute_s
        self.flags: dict[tuple[Any, ...], int] = {}
        self.attention = SimStream(self, "sim-attention")
        self.ffn = SimStream(self, "sim-ffn")
        self.attention.start()
        self.ffn.start()
        self.poisoned = 0

    def event(self, stream: SimStream) -> SimEvent:
        event = SimEvent()
        stream.queue.append(("event", event))
        return event

    def attention_step(self, rows: int = 2) -> None:
        """Every layer's round trip on the attention stream (what a replayed graph enqueues)."""
        for layer in range(self.layers):
            for op in attention_ops(0, layer % 1, rows, 1, False):
                self.attention.queue.append(("op", op))

    def ffn_step(self, rows: int = 2) -> None:
        peers = [AttentionPeer(0, 0, 0, rows)]
        for layer in range(self.layers):
            for op in ffn_ops(0, layer, 0, layer % 1, peers, False):
                if isinstance(op, Compute):
                    self.ffn.queue.append(("compute", self.ffn_compute_s))
                else:
                    self.ffn.queue.append(("op", op))

    def poison(self) -> None:
        """What GpuHop.poison does on the attention side: POISON into every flag its stream
        waits on."""
        self.poisoned += 1
        for area, index in FlagLayout(1, 1).flags_waited_on():
            self.flags[("attention", 0, area, index)] = POISON

    def kill_ffn(self) -> None:
        self.ffn.dead = True

    def drained(self) -> bool:
        return not self.attention.queue

    def stop(self) -> None:
        for stream in (self.attention, self.ffn):
            stream.stopped = True
            stream.join(timeout=5)
