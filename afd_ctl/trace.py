"""`afd-ctl trace` (issue 26): one trace across workers, clocks aligned through the daemon.

Clock alignment is NTP's two-way method over each worker's Session stream. The daemon sends
TraceStart at t0 (its monotonic clock); the worker notes t1 when it arrives and t2 when it
sends its spans back; the daemon notes t3 on arrival. The worker's clock plus

    offset = ((t0 - t1) + (t3 - t2)) / 2

is the daemon's clock, within +-error = ((t3 - t0) - (t2 - t1)) / 2: half the round trip,
less the time the worker held the request. The bound holds whatever the two one-way delays
are (the true offset lies in [t0 - t1, t3 - t2]); drift over a trace of a few seconds is
far below it. On one host every process shares CLOCK_MONOTONIC and the true offset is 0.

The output is the Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): one process
per worker, "X" complete events in microseconds on the daemon's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from afd_ctl.logs import UNPRINTABLE, clip
from afd_ctl.v1 import afd_pb2

MAX_TRACE_STEPS = 1000
DEFAULT_TRACE_TIMEOUT_S = 30.0
# An idle pair: no step relayed or reported for this long since the trace was asked.
TRACE_IDLE_S = 5.0
# Spans kept per worker (what a reporter sends at most) and over all workers of one trace, so a
# TraceResult stays far below gRPC's 64 MiB message limit.
MAX_SPANS_PER_WORKER = 20000
MAX_SPANS_TOTAL = 500_000
MAX_SPAN_NAME_CHARS = 32
# A span must lie within this of the trace's window on the daemon's clock (TraceStart sent ..
# answer received): further out is a broken clock, not a step of this trace.
SPAN_SLACK_S = 60.0
PHASES = {"B", "E", "X", "i", "I", "M", "C"}
# Timestamps are rounded to 1 ns; spans that abut may then overlap by that much.
EPS_US = 0.01


def align(t0: float, t1: float, t2: float, t3: float) -> tuple[float, float]:
    """(offset to add to the worker's clock, bound on its error), seconds."""
    offset = ((t0 - t1) + (t3 - t2)) / 2
    error = max(0.0, ((t3 - t0) - (t2 - t1)) / 2)
    return offset, error


@dataclass
class PendingTrace:
    """A trace the daemon asked for: who was asked and what came back."""

    trace_id: int
    first_step_id: int
    steps: int
    sent_at: float  # t0, daemon monotonic
    asked: dict[str, afd_pb2.WorkerInfo]
    answers: dict[str, afd_pb2.WorkerTrace] = field(default_factory=dict)
    # Asked workers whose session ended before they answered, and what was refused (lines).
    gone: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    spans_kept: int = 0

    @property
    def complete(self) -> bool:
        return len(self.answers) + len(self.gone - set(self.answers)) >= len(self.asked)

    def left(self, worker_id: str) -> None:
        if worker_id in self.asked and worker_id not in self.answers:
            self.gone.add(worker_id)
            self.problems.append(f"{worker_id}: its session ended before it answered")

    def take(self, worker_id: str, spans: afd_pb2.TraceSpans, received_at: float) -> bool:
        if spans.trace_id != self.trace_id or worker_id not in self.asked:
            return False
        if worker_id in self.answers or worker_id in self.gone:
            return False
        t1, t2 = spans.worker_received_s, spans.worker_sent_s
        if not (math.isfinite(t1) and math.isfinite(t2)) or t2 < t1:
            self.problems.append(
                f"{worker_id}: clock readings received {t1!r}, sent {t2!r} are not finite or "
                "out of order; its spans are left out"
            )
            self.gone.add(worker_id)
            return False
        offset, error = align(self.sent_at, t1, t2, received_at)
        answer = afd_pb2.WorkerTrace(offset_s=offset, offset_error_s=error)
        answer.worker.CopyFrom(self.asked[worker_id])
        earliest, latest = self.sent_at - SPAN_SLACK_S, received_at + SPAN_SLACK_S
        refused, first_why = 0, ""
        room = min(MAX_SPANS_PER_WORKER, MAX_SPANS_TOTAL - self.spans_kept)
        for span in spans.spans:
            if not self.first_step_id <= span.step_id < self.first_step_id + self.steps:
                continue
            start, end = span.start_s + offset, span.end_s + offset
            why = span_refusal(span, start, end, earliest, latest)
            if not why and len(answer.spans) >= room:
                why = f"more than {room} spans"
            if why:
                refused += 1
                first_why = first_why or why
                continue
            answer.spans.add(
                name=span.name, step_id=span.step_id, start_s=start, end_s=end, layer=span.layer
            )
        if refused:
            self.problems.append(f"{worker_id}: {refused} span(s) left out, the first: {first_why}")
        elif not answer.spans:
            self.problems.append(
                f"{worker_id}: sent no spans of steps {self.first_step_id}.."
                f"{self.first_step_id + self.steps - 1}: the request reached it after those "
                "steps (a loaded host) or it ran none of them; run afd-ctl trace again"
            )
        self.spans_kept += len(answer.spans)
        self.answers[worker_id] = answer
        return True

    def result(self) -> afd_pb2.TraceResult:
        result = afd_pb2.TraceResult(
            first_step_id=self.first_step_id, steps=self.steps, problems=self.problems
        )
        for worker_id in sorted(self.asked):
            if worker_id in self.answers:
                result.workers.append(self.answers[worker_id])
            else:
                result.missing.append(worker_id)
        return result


def span_refusal(
    span: afd_pb2.TraceSpan, start: float, end: float, earliest: float, latest: float
) -> str:
    """Why one span is left out of a trace ("" when kept): `start` and `end` are its times on
    the daemon's clock, which must lie within [earliest, latest]."""
    if not span.name or len(span.name) > MAX_SPAN_NAME_CHARS or UNPRINTABLE.search(span.name):
        return f"name {clip(span.name, MAX_SPAN_NAME_CHARS)!r} is not a span name"
    if not (math.isfinite(start) and math.isfinite(end)):
        return f"{span.name} of step {span.step_id} has a time that is not finite"
    if end < start:
        return f"{span.name} of step {span.step_id} ends before it starts"
    if start < earliest or end > latest:
        return (
            f"{span.name} of step {span.step_id} lies {max(earliest - start, end - latest):.3g} s "
            f"outside the trace's window on the daemon's clock (more than {SPAN_SLACK_S:g} s "
            "from it): the worker's clock readings are wrong"
        )
    if not -1 <= span.layer <= 1 << 16:
        return f"{span.name} of step {span.step_id} has layer {span.layer}"
    return ""


def to_chrome(result: afd_pb2.TraceResult) -> dict[str, Any]:
    """Trace-event JSON: process per worker (attention first), spans nested and ordered."""
    events: list[dict[str, Any]] = []
    workers = sorted(result.workers, key=lambda w: (w.worker.role, w.worker.role_rank))
    starts = [s.start_s for w in workers for s in w.spans]
    origin = min(starts) if starts else 0.0
    for pid, w in enumerate(workers, start=1):
        role = afd_pb2.Role.Name(w.worker.role).lower()
        name = f"{role} {w.worker.role_rank} ({w.worker.worker_id})"
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        # Outer spans first when two start together, so viewers nest them.
        spans = sorted(w.spans, key=lambda s: (s.start_s, -(s.end_s - s.start_s)))
        for s in spans:
            args: dict[str, Any] = {"step": s.step_id}
            if s.layer >= 0:
                args["layer"] = s.layer
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": role,
                    "pid": pid,
                    "tid": 1,
                    "ts": round((s.start_s - origin) * 1e6, 3),
                    "dur": round(max(0.0, s.end_s - s.start_s) * 1e6, 3),
                    "args": args,
                }
            )
    alignment = {
        w.worker.worker_id: {"offset_us": w.offset_s * 1e6, "error_us": w.offset_error_s * 1e6}
        for w in workers
    }
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "first_step_id": result.first_step_id,
            "steps": result.steps,
            "missing_workers": list(result.missing),
            "clock_alignment": "NTP two-way over each worker's Session stream: offset = "
            "((t0-t1)+(t3-t2))/2, error <= ((t3-t0)-(t2-t1))/2 (afd_ctl/trace.py)",
            "alignment": alignment,
        },
    }


def check_trace_events(doc: Any) -> list[str]:
    """Problems with `doc` as trace-event JSON (empty: fine): required keys and types, known
    phase values, and on every (pid, tid) complete events that are ordered by start and
    nest properly (each one either inside the enclosing one or after it)."""
    problems: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents list"]
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, event in enumerate(doc["traceEvents"]):
        if not isinstance(event, dict):
            problems.append(f"event {i} is not an object")
            continue
        missing = [
            f"event {i}: {key!r} missing or not {kind.__name__}"
            for key, kind in (("ph", str), ("name", str), ("pid", int), ("tid", int))
            if not isinstance(event.get(key), kind)
        ]
        if missing:
            problems += missing
            continue
        ph = event.get("ph")
        if ph not in PHASES:
            problems.append(f"event {i}: ph {ph!r} is not one of {sorted(PHASES)}")
        if ph == "M":
            if not isinstance(event.get("args"), dict):
                problems.append(f"event {i}: metadata event without args")
            continue
        ts = event.get("ts")
        if not isinstance(ts, (int, float)) or ts < 0:
            problems.append(f"event {i}: ts missing or negative")
            continue
        if ph == "X":
            dur = event.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"event {i}: X event without a non-negative dur")
                continue
            tracks.setdefault((event["pid"], event["tid"]), []).append(
                (float(ts), float(ts) + float(dur), str(event.get("name")))
            )
    for (pid, tid), spans in tracks.items():
        stack: list[tuple[float, float, str]] = []
        last_start = -1.0
        for start, end, name in spans:
            if start < last_start:
                problems.append(f"pid {pid} tid {tid}: {name!r} at {start} is out of order")
            last_start = start
            while stack and start >= stack[-1][1] - EPS_US:
                stack.pop()
            if stack and end > stack[-1][1] + EPS_US:
                problems.append(
                    f"pid {pid} tid {tid}: {name!r} [{start}, {end}] overlaps "
                    f"{stack[-1][2]!r} ending at {stack[-1][1]} without nesting"
                )
            stack.append((start, end, name))
    return problems
