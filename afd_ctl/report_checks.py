"""What a worker's step-timing report may say before the daemon keeps it (issue 39).

A report is a worker's own account of its steps, and a worker is a client like any other:
unknown fields, NaN, infinities, negative or absurd times, step ids near 2^64, a `layers` that
is not the registered model's, or more tokens in a step than the daemon ever relayed to it
would otherwise be stored as sent and poison `status`, `/metrics`, `advise` and `trace` for
everyone. `checked_report` returns a clean copy holding only the known fields, or why not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from afd_ctl.v1 import afd_pb2

# Step ids count steps from 1: a worker at a million steps a second reaches 2^62 in 146,000
# years. Bounded so that a trace's step range (last id + steps + 2) never overflows 64 bits.
MAX_STEP_ID = 1 << 62
MAX_STEP_ENTRIES = 256
# A report covers about a second; no time in it may exceed this (seconds).
MAX_SECONDS = 1e6
MAX_LAYERS = 4096
# Tokens in one step when the daemon has not relayed any step to the worker's group yet.
MAX_STEP_TOKENS = 1 << 24
MAX_BYTES_PER_STEP = 1 << 40
# compute, wait and send each lie inside the busy wall time; this much slack for rounding.
WALL_SLACK = 1.01
WALL_SLACK_S = 1e-3
# The largest a checked report can be: 256 entries of 3 figures plus the sums.
MAX_REPORT_BYTES = 8 << 10


@dataclass(frozen=True)
class Expected:
    """What the daemon knows of the reporting worker (0: not known)."""

    layers: int = 0  # the registered model's
    max_step_tokens: int = 0  # the largest step relayed to the worker's group


def _bad_time(name: str, value: float) -> str:
    if math.isnan(value):
        return f"{name} is NaN"
    if math.isinf(value):
        return f"{name} is infinite"
    if value < 0:
        return f"{name} is negative ({value:g})"
    if value > MAX_SECONDS:
        return f"{name} is {value:g} s, above {MAX_SECONDS:g} s"
    return ""


def _bad_times(name: str, values: Iterable[float]) -> str:
    for i, value in enumerate(values):
        why = _bad_time(f"{name}[{i}]", value)
        if why:
            return why
    return ""


# What a worker may say of its exchange path ("" from a worker that does not say).
EXCHANGE_PATHS = ("", "gpu", "nixl")


def refusal(report: afd_pb2.StepTimings, expected: Expected = Expected()) -> str:
    """Why `report` is refused, or "" (one short clause, for logs and `status --json`)."""
    steps = report.steps
    if steps == 0:
        return "no steps"
    for name in ("first_step_id", "last_step_id"):
        if getattr(report, name) > MAX_STEP_ID:
            return f"{name} {getattr(report, name)} is above 2^62"
    n = len(report.step_compute_s)
    if max(n, len(report.step_wait_s), len(report.step_tokens)) > MAX_STEP_ENTRIES:
        return f"more than {MAX_STEP_ENTRIES} per-step entries"
    if len(report.step_wait_s) != n or len(report.step_tokens) != n:
        return "step_compute_s, step_wait_s and step_tokens differ in length"
    if report.exchange_path not in EXCHANGE_PATHS:
        return f"exchange_path {report.exchange_path[:16]!r} is none of {EXCHANGE_PATHS[1:]}"
    if n and n != min(steps, MAX_STEP_ENTRIES):
        return f"{n} per-step entries for {steps} steps (one per step, up to {MAX_STEP_ENTRIES})"
    for name in ("busy_wall_s", "compute_s", "wait_s", "send_s"):
        why = _bad_time(name, getattr(report, name))
        if why:
            return why
    limit = report.busy_wall_s * WALL_SLACK + WALL_SLACK_S
    for name in ("compute_s", "wait_s", "send_s"):
        if getattr(report, name) > limit:
            return (
                f"{name} {getattr(report, name):g} s exceeds busy_wall_s {report.busy_wall_s:g} s"
            )
    why = _bad_times("step_compute_s", report.step_compute_s) or _bad_times(
        "step_wait_s", report.step_wait_s
    )
    if why:
        return why
    if expected.layers and report.layers and report.layers != expected.layers:
        return f"layers {report.layers} is not the registered model's {expected.layers}"
    if report.layers > MAX_LAYERS:
        return f"layers {report.layers} is above {MAX_LAYERS}"
    most = expected.max_step_tokens or MAX_STEP_TOKENS
    where = "the largest step relayed to its group" if expected.max_step_tokens else "the bound"
    biggest = max(report.step_tokens, default=0)
    if biggest > most:
        return f"a step of {biggest} tokens, above {where} ({most})"
    if report.tokens > most * steps:
        return f"{report.tokens} tokens in {steps} steps, above {where} ({most} a step)"
    if n == steps and sum(report.step_tokens) != report.tokens:
        return f"step_tokens sum to {sum(report.step_tokens)}, not tokens {report.tokens}"
    if report.bytes > MAX_BYTES_PER_STEP * steps:
        return f"bytes {report.bytes} is above {MAX_BYTES_PER_STEP} a step"
    return ""


def known_fields(report: afd_pb2.StepTimings) -> afd_pb2.StepTimings:
    """A copy with the fields this daemon knows, nothing else (unknown fields are dropped)."""
    return afd_pb2.StepTimings(
        first_step_id=report.first_step_id,
        last_step_id=report.last_step_id,
        steps=report.steps,
        busy_wall_s=report.busy_wall_s,
        compute_s=report.compute_s,
        wait_s=report.wait_s,
        send_s=report.send_s,
        bytes=report.bytes,
        tokens=report.tokens,
        layers=report.layers,
        step_compute_s=report.step_compute_s,
        step_wait_s=report.step_wait_s,
        step_tokens=report.step_tokens,
        warmup=report.warmup,
        exchange_path=report.exchange_path,
    )


def checked_report(
    report: afd_pb2.StepTimings, expected: Expected = Expected()
) -> tuple[afd_pb2.StepTimings | None, str]:
    """(a clean copy of `report`, "") or (None, why it is refused)."""
    why = refusal(report, expected)
    if why:
        return None, why
    clean = known_fields(report)
    if clean.ByteSize() > MAX_REPORT_BYTES:  # cannot happen within the bounds above
        return None, f"{clean.ByteSize()} bytes, above {MAX_REPORT_BYTES}"
    return clean, ""
