"""Prometheus metrics, read from the controller's state on scrape (nothing on the hot path).

The scrape runs on prometheus_client's HTTP thread while the controller changes on the event
loop, so the collector asks the loop for a `MetricsSnapshot` and reads only that.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from afd_ctl.controller import Controller
from afd_ctl.membership import ROLES
from afd_ctl.step_window import BUCKETS_S, Histogram
from afd_ctl.v1 import afd_pb2

# A scrape waits this long for the event loop; a loop that busy is itself worth an error.
SNAPSHOT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MetricsSnapshot:
    """The numbers a Prometheus scrape reports, copied on the event loop in one go so that the
    scrape thread never reads the controller's state while it changes."""

    epoch: int
    serving: bool
    registered: dict[str, int]
    expected: dict[str, int]
    steps_relayed: int
    payloads_rejected: int
    joins: int
    losses: int
    last_step_id: int
    queued: dict[str, int]
    # Issue 26: per worker id, its role and per-phase histograms of per-step seconds.
    step_histograms: dict[str, tuple[str, dict[str, Histogram]]] = dataclasses.field(
        default_factory=dict
    )
    loads: list[afd_pb2.WorkerLoad] = dataclasses.field(default_factory=list)


def metrics_snapshot(c: Controller) -> MetricsSnapshot:
    """Call on the event loop (the scrape thread asks the loop for it)."""
    m = c.membership
    return MetricsSnapshot(
        epoch=m.epoch,
        serving=c.health == "SERVING",
        registered={role: m.count(role) for role in ROLES},
        expected=dict(m.expected),
        steps_relayed=c.steps_relayed,
        payloads_rejected=c.payloads_rejected,
        joins=m.joins,
        losses=m.losses,
        last_step_id=c.last_step_id,
        queued={s.worker.worker_id: len(s.mailbox) for s in c.sessions.values()},
        step_histograms=c.timing.histograms(),
        loads=c.timing.loads(),
    )


class ControllerCollector(Collector):
    def __init__(self, controller: Controller, loop: asyncio.AbstractEventLoop) -> None:
        self.controller = controller
        self.loop = loop

    def snapshot(self) -> MetricsSnapshot:
        async def take() -> MetricsSnapshot:
            return metrics_snapshot(self.controller)

        return asyncio.run_coroutine_threadsafe(take(), self.loop).result(SNAPSHOT_TIMEOUT_S)

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield GaugeMetricFamily("afd_ctl_epoch", "Current membership epoch", value=s.epoch)
        yield GaugeMetricFamily(
            "afd_ctl_serving",
            "1 when the expected set is complete and not draining",
            value=1 if s.serving else 0,
        )
        registered = GaugeMetricFamily(
            "afd_ctl_workers_registered", "Registered workers per role", labels=["role"]
        )
        expected = GaugeMetricFamily(
            "afd_ctl_workers_expected", "Expected workers per role", labels=["role"]
        )
        for role in ROLES:
            registered.add_metric([role.lower()], s.registered[role])
            expected.add_metric([role.lower()], s.expected[role])
        yield registered
        yield expected
        yield CounterMetricFamily(
            "afd_ctl_steps_relayed", "Payloads accepted and fanned out", value=s.steps_relayed
        )
        yield CounterMetricFamily(
            "afd_ctl_payloads_rejected", "Payloads refused", value=s.payloads_rejected
        )
        yield CounterMetricFamily("afd_ctl_worker_joins", "Registrations", value=s.joins)
        yield CounterMetricFamily("afd_ctl_workers_lost", "Workers declared lost", value=s.losses)
        yield GaugeMetricFamily(
            "afd_ctl_last_step_id", "Last relayed step id", value=s.last_step_id
        )
        queued = GaugeMetricFamily(
            "afd_ctl_subscriber_queued", "Messages queued per worker session", labels=["worker_id"]
        )
        for worker_id, count in s.queued.items():
            queued.add_metric([worker_id], count)
        yield queued
        yield from step_metrics(s)


def step_metrics(s: MetricsSnapshot) -> Iterator[Metric]:
    """Issue 26: per-step compute and wait histograms and each worker's load, from the
    workers' StepTimings reports (nothing for workers that do not report)."""
    labels = ["worker_id", "role"]
    for phase, what in (
        ("compute", "attention or FFN compute"),
        ("wait", "exchange wait (attention) or receive wait (FFN)"),
    ):
        family = HistogramMetricFamily(
            f"afd_ctl_step_{phase}_seconds", f"Per-step {what}, as workers report it", labels=labels
        )
        for worker_id, (role, histograms) in sorted(s.step_histograms.items()):
            h = histograms[phase]
            buckets = [
                (str(bound), count) for bound, count in zip(BUCKETS_S, h.counts, strict=True)
            ]
            buckets.append(("+Inf", h.total))
            family.add_metric([worker_id, role.lower()], buckets, h.sum_s)
        yield family
    for name, field, help_text in (
        ("afd_ctl_worker_utilisation", "utilisation", "Compute over busy time, rolling window"),
        ("afd_ctl_worker_waiting_share", "waiting_share", "Waiting over busy time, rolling window"),
        ("afd_ctl_worker_tokens_per_step", "tokens_per_step", "Tokens per step, rolling window"),
    ):
        gauge = GaugeMetricFamily(name, help_text, labels=["worker_id"])
        for load in s.loads:
            gauge.add_metric([load.worker_id], getattr(load, field))
        yield gauge


def serve_metrics(controller: Controller, host: str, port: int) -> int:
    """Starts the HTTP endpoint (call on the event loop); returns the port it got (`port` -1:
    one the kernel picks); OSError naming --metrics-port when it cannot bind."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(controller, asyncio.get_running_loop()))
    try:
        server, _ = start_http_server(max(port, 0), addr=host, registry=registry)
    except OSError as exc:
        raise OSError(
            f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}; "
            "pick another --metrics-port, or 0 to turn metrics off"
        ) from None
    return int(server.server_port)
