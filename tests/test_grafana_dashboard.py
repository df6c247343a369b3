"""deploy/grafana/afd.json is a loadable Grafana dashboard whose every query names series the
code exports. This file checks its shape; tests/test_vllm_metrics.py checks that every series
it queries is on a live pair's /metrics pages (afd-ctl's, the attention server's, the FFN
server's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "afd.json"
# Series names in PromQL: ours (afd_, afd_ctl_) and vLLM's own (vllm:).
SERIES_RE = re.compile(r"\b(afd_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def dashboard_panels() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels += panel.get("panels", [])
    return panels


def dashboard_series() -> set[str]:
    """Every series name the dashboard's queries read, as a /metrics page spells its samples
    (`_total`, `_bucket` as written in the query)."""
    return {
        name
        for panel in dashboard_panels()
        for target in panel.get("targets", [])
        for name in SERIES_RE.findall(target["expr"])
    }


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert SERIES_RE.search(target["expr"]), (panel["title"], target["expr"])
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]


def exported_families() -> set[str]:
    """Every afd_* family the code exports: the daemon's (afd_ctl/metrics.py) and the workers'
    (vllm_ext/metrics.py), each named there as a string literal."""
    code = (ROOT / "afd_ctl" / "metrics.py").read_text() + (
        ROOT / "vllm_ext" / "metrics.py"
    ).read_text()
    code = code.replace(  # the daemon's two step histograms are named by one f-string
        'f"afd_ctl_step_{phase}_seconds"',
        '"afd_ctl_step_compute_seconds" "afd_ctl_step_wait_seconds"',
    )
    return set(re.findall(r'"(afd_[a-z0-9_]+)"', code))


def queried_families() -> set[str]:
    return {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in dashboard_series()}


def test_every_afd_series_it_queries_is_defined_in_the_code() -> None:
    """The cheap half of the live check: each afd_* family is named in the code that exports
    it (afd_ctl/metrics.py for the daemon, vllm_ext/metrics.py for the workers)."""
    missing = sorted(f for f in queried_families() if f.startswith("afd_"))
    missing = [f for f in missing if f not in exported_families()]
    assert not missing, missing


def test_every_afd_series_the_code_exports_has_a_panel() -> None:
    """A series added to the daemon or the workers needs a panel too (issue 38: membership,
    epochs, step rates, hop and exchange-wait quantiles, failures, planned changes and holds)."""
    assert len(exported_families()) >= 30
    unshown = sorted(exported_families() - queried_families())
    assert not unshown, f"no panel of deploy/grafana/afd.json queries {unshown}: add one"
