"""Prometheus metrics, read from the controller's state on scrape (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from afd_ctl.controller import Controller
from afd_ctl.membership import ROLES


class ControllerCollector(Collector):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        c = self.controller
        m = c.membership
        yield GaugeMetricFamily("afd_ctl_epoch", "Current membership epoch", value=m.epoch)
        yield GaugeMetricFamily(
            "afd_ctl_serving",
            "1 when the expected set is complete and not draining",
            value=1 if c.health == "SERVING" else 0,
        )
        registered = GaugeMetricFamily(
            "afd_ctl_workers_registered", "Registered workers per role", labels=["role"]
        )
        expected = GaugeMetricFamily(
            "afd_ctl_workers_expected", "Expected workers per role", labels=["role"]
        )
        for role in ROLES:
            registered.add_metric([role.lower()], m.count(role))
            expected.add_metric([role.lower()], m.expected[role])
        yield registered
        yield expected
        yield CounterMetricFamily(
            "afd_ctl_steps_relayed", "Payloads accepted and fanned out", value=c.steps_relayed
        )
        yield CounterMetricFamily(
            "afd_ctl_payloads_rejected", "Payloads refused", value=c.payloads_rejected
        )
        yield CounterMetricFamily("afd_ctl_worker_joins", "Registrations", value=m.joins)
        yield CounterMetricFamily("afd_ctl_workers_lost", "Workers declared lost", value=m.losses)
        yield GaugeMetricFamily(
            "afd_ctl_last_step_id", "Last relayed step id", value=c.last_step_id
        )
        queued = GaugeMetricFamily(
            "afd_ctl_subscriber_queued", "Messages queued per worker session", labels=["worker_id"]
        )
        for session in c.sessions.values():
            queued.add_metric([session.worker.worker_id], len(session.mailbox))
        yield queued


def serve_metrics(controller: Controller, host: str, port: int) -> None:
    """Serves /metrics from a thread; OSError naming --metrics-port when it cannot bind."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(controller))
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(
            f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}; "
            "pick another --metrics-port, or 0 to turn metrics off"
        ) from None
