"""The steps a GPU-driven worker has enqueued, watched beside the host instead of waited for.

The host enqueues a whole step (or replays its CUDA graph) and goes on: on the attention side
vLLM schedules and prepares the next step while the GPUs run this one, as it does without AFD.
A GPU wait cannot time out by itself, so this watches each enqueued step's end event: once a
peer is lost (`lost()` names it) or a step passes its bound, every step still in flight is
marked failed, the data plane is marked lost (`mark_lost`), and POISON goes into every flag
this side's stream may wait on (`poison`), again and again until the stream has drained. A
failed step's outputs are never used: its verdict (`verdict`) raises where vLLM first reads
what the step produced, and every later step fails until the worker reconnects (`reset`).

`poll()` does one round; the attention worker runs it on a thread (`start`), since vLLM's host
may block in a device sync that only the poison releases; the FFN server calls it from its own
loop (`check`). Each step's GPU time (from its start to its end event) is kept for the step
timings, read without a sync: only once the end event has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from afd_ctl.errors import AfdTimeout
from afd_ctl.threads import named_thread
from afd_data.errors import AfdPeerLost

log = logging.getLogger(__name__)

POISON_EVERY_S = 200e-6
# After the poison: a stream that still has not drained waits on something nothing releases.
POISONED_DRAIN_S = 10.0
POLL_S = 1e-3
# The watchdog thread's wait while no step is in flight (enqueue wakes it only after a loss).
IDLE_S = 0.05
# The thread's round while steps are in flight: it looks for an overrun (the bounds are
# seconds). A loss wakes it at once (`wake`, which the data plane's loss record calls), and a
# verdict never waits on it (it retires finished steps itself). Each round takes the GIL from
# vLLM's engine thread (41 us on an H100 host; at 5 ms, 135 us of a 11.8 ms step at batch 256).
WATCH_S = 50e-3
# Verdicts kept for steps not yet asked about (a verdict is asked once, within a step or two).
KEPT_VERDICTS = 4096
LOST = "afd peer lost: "  # how a loss's reason starts (afd_ctl.errors.AfdPeerLost)


def failure_error(why: str) -> Exception:
    """The error a step failed with: AfdPeerLost for a loss, AfdTimeout past its bound."""
    return AfdPeerLost(why.removeprefix(LOST)) if why.startswith(LOST) else AfdTimeout(why)


class Event(Protocol):
    """What the watchdog needs of a CUDA event (vllm_ext.exchange.gpu's; the tests' simulated
    stream provides its own)."""

    def query(self) -> bool: ...

    def elapsed_s(self, end: Any) -> float: ...


@dataclass
class InFlight:
    step_id: int
    start: Event | None
    end: Event
    bound_s: float
    enqueued_at: float  # host monotonic time when its last operation was enqueued
    host_s: float  # the host's time in the step (open to enqueue)
    tokens: int = 0
    nbytes: int = 0
    warmup: bool = False  # a warm-up, profile or capture step
    # The control hop (monotonic): the attention side published the step's payload / the FFN
    # side took it; 0.0 where not known (for the timeline).
    control_at: float = 0.0


@dataclass(frozen=True)
class Retired:
    """A step that ran to its end: its GPU time (0.0 where it had no start event), and its
    events, for placing it on the host's clock."""

    step_id: int
    gpu_s: float
    host_s: float
    tokens: int
    nbytes: int
    ended_at: float  # monotonic time when its end was seen (an upper bound)
    enqueued_at: float = 0.0
    start: Event | None = None
    end: Event | None = None
    warmup: bool = False
    control_at: float = 0.0


class StepWatchdog:
    def __init__(
        self,
        *,
        poison: Callable[[], None],
        lost: Callable[[], str | None],
        mark_lost: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._poison = poison
        self._lost = lost
        self._mark_lost = mark_lost
        self._clock = clock
        self._sleep = sleep
        self._cond = threading.Condition()
        self._inflight: deque[InFlight] = deque()
        # step id -> None (ran to its end) or why it failed; asked once by `verdict`.
        self._verdicts: OrderedDict[int, str | None] = OrderedDict()
        self._failure: str | None = None  # sticky until reset(): every later step fails
        self._failure_told = False
        self._retired: deque[Retired] = deque(maxlen=KEPT_VERDICTS)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._woken = threading.Event()  # a loss: look now, not at the next round
        self.fatal: str | None = None  # the stream never drained after the poison
        self.enqueued = 0  # steps enqueued
        # The watch thread's rounds and its time in them (the interpreter lock it takes from
        # the engine's thread while the host paces the step).
        self.thread_rounds = 0
        self.thread_s = 0.0

    # -- the host's side ------------------------------------------------------------------
    def enqueue(self, step: InFlight) -> None:
        """A step is on the stream (its end event recorded after its last operation)."""
        with self._cond:
            self.enqueued += 1
            if self._failure is not None:
                # Enqueued after a failure was declared: it may consume poison.
                self._verdict(step.step_id, self._failure)
                self._inflight.append(step)  # drained (and poisoned) like the others
            else:
                self._inflight.append(step)
            # No notify: waking the watchdog's thread per step took the interpreter lock from
            # the engine's; it looks within its idle wait (IDLE_S), far inside any bound. But a
            # step enqueued after a loss its round may already have passed is looked at now.
            if self._lost() is not None:
                self._woken.set()

    def verdict(self, step_ids: Iterable[int], bound_s: float) -> None:
        """Raises AfdPeerLost or AfdTimeout if any of these steps failed; waits (bounded) for
        a step still in flight. vLLM calls it after its own sync on the step's outputs, so
        the wait is normally none."""
        for step_id in step_ids:
            why = self._settled(step_id, bound_s + POISONED_DRAIN_S + 1.0)
            if why is not None:
                raise failure_error(why)

    def _settled(self, step_id: int, wait_s: float) -> str | None:
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                self._retire_done()
                if step_id in self._verdicts:
                    return self._verdicts.pop(step_id)
                if not any(s.step_id == step_id for s in self._inflight):
                    return None  # never enqueued here (a recorded capture) or asked before
                if self._clock() >= deadline:
                    return f"step {step_id} has no verdict after {wait_s:.0f} s (vllm_ext bug)"
                self._cond.wait(min(POLL_S, max(0.0, deadline - self._clock())))

    def take_retired(self, look: bool = True) -> list[Retired]:
        """Steps that ran to their end since the last call (for the step timings); `look`:
        query the oldest step in flight first (a driver call), else only those a verdict or a
        round has retired."""
        with self._cond:
            if look:
                self._retire_done()
            out = list(self._retired)
            self._retired.clear()
        return out

    def drain(self, reason: str, bound_s: float) -> None:
        """Before a reconnect or close: waits until every enqueued step has left the stream,
        releasing them with poison once `bound_s` passes (or a peer is lost)."""
        deadline = self._clock() + bound_s
        while True:
            with self._cond:
                self._retire_done()
                if not self._inflight:
                    return
            if self._clock() >= deadline and self._failure is None:
                self._fail(f"the GPU-driven exchange did not drain ({reason})")
            self.poll()
            if self.fatal is not None:
                raise RuntimeError(self.fatal)
            self._sleep(POLL_S)

    def take_failure(self) -> str | None:
        """The failure of the steps in flight, once (the host fails its next step at once
        instead of waiting for afd-ctl's next view before it)."""
        with self._cond:
            if self._failure is None or self._failure_told:
                return None
            self._failure_told = True
            return self._failure

    def reset(self) -> None:
        """After a reconnect: the stream is empty and the flags are zeroed; steps may run."""
        with self._cond:
            self._inflight.clear()
            self._failure = None
            self._failure_told = False

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # -- the watch ------------------------------------------------------------------------
    def poll(self) -> str | None:
        """One round: retires finished steps; a loss or an overrun fails every step in flight
        and poisons until the stream has drained. Returns the failure, if any."""
        with self._cond:
            self._retire_done()
            if not self._inflight:
                return self._failure
            head = self._inflight[0]
            if self._failure is None:
                loss = self._lost()
                if loss is not None:
                    self._fail_locked(f"{LOST}{loss}")
                elif self._clock() - head.enqueued_at > head.bound_s:
                    self._fail_locked(
                        f"step {head.step_id}: the GPU-driven exchange did not finish within "
                        f"{head.bound_s:.1f} s"
                    )
            failure = self._failure
        if failure is not None:
            self._release()
        return failure

    def _fail(self, why: str) -> None:
        with self._cond:
            self._fail_locked(why)

    def _fail_locked(self, why: str) -> None:
        """Marks every step in flight failed before anything is poisoned (so a step whose end
        passes after the poison can never be taken for a good one), then the plane lost."""
        if self._failure is None:
            self._failure = why
            log.warning("afd data path: releasing the GPU stream's waits: %s", why)
        for step in self._inflight:
            self._verdict(step.step_id, self._failure)
        self._mark_lost(why)

    def _release(self) -> None:
        """Poisons until every step in flight has left the stream (bounded)."""
        deadline = self._clock() + POISONED_DRAIN_S
        while True:
            with self._cond:
                self._retire_done()
                if not self._inflight:
                    return
            if self._clock() > deadline:
                self.fatal = (
                    f"GPU hop: the stream did not drain {POISONED_DRAIN_S:.0f} s after its "
                    f"flags were poisoned ({self._failure}); the CUDA context may be unusable"
                )
                log.error("afd data path: %s", self.fatal)
                return
            self._poison()
            self._sleep(POISON_EVERY_S)

    def _retire_done(self) -> None:
        """Pops finished steps off the head (under the lock)."""
        changed = False
        while self._inflight and self._inflight[0].end.query():
            step = self._inflight.popleft()
            changed = True
            if step.step_id not in self._verdicts:
                self._verdict(step.step_id, None)
                gpu_s = step.start.elapsed_s(step.end) if step.start is not None else 0.0
                self._retired.append(
                    Retired(
                        step.step_id,
                        gpu_s,
                        step.host_s,
                        step.tokens,
                        step.nbytes,
                        self._clock(),
                        step.enqueued_at,
                        step.start,
                        step.end,
                        step.warmup,
                        step.control_at,
                    )
                )
        if changed:
            self._cond.notify_all()

    def _verdict(self, step_id: int, why: str | None) -> None:
        if why is None and self._verdicts.get(step_id) is not None:
            return  # a failure stands
        self._verdicts[step_id] = why
        while len(self._verdicts) > KEPT_VERDICTS:
            self._verdicts.popitem(last=False)

    # -- a thread for the attention side -----------------------------------------------------
    def start(self, setup: Callable[[], None] = lambda: None) -> None:
        """Runs `poll` on a daemon thread every WATCH_S while steps are in flight; `setup` runs
        first on that thread (the CUDA device for its driver calls)."""
        if self._thread is not None:
            return

        def loop() -> None:
            setup()
            while not self._stop.is_set():
                self._woken.clear()  # before looking: a wake from here on ends the wait below
                if self._stop.is_set():  # stop() set both: its wake was just cleared
                    return
                if not self._inflight:
                    # Not on the condition: every retired step notifies it (for a verdict that
                    # waits), and the runner retires a step at every verdict.
                    self._woken.wait(IDLE_S)
                    continue
                started = time.perf_counter()
                self.poll()
                self.thread_s += time.perf_counter() - started
                self.thread_rounds += 1
                self._woken.wait(WATCH_S)

        self._thread = named_thread(loop, "afd-gpu-watchdog", os_name="afd-gpu-watch")
        self._thread.start()

    def wake(self) -> None:
        """A peer was lost: the thread's next round starts now (any thread may call this)."""
        self._woken.set()

    def stop(self) -> None:
        self._stop.set()
        self._woken.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
