"""The Grafana dashboard: valid JSON, the panels the issue asks for, PromQL that promtool
parses and that uses documented metric names and labels only."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.promql import analyse, problems
from tests.deploy.tools import (
    DEPLOY,
    dashboard_panel_exprs,
    dashboard_panels,
    dashboard_variable_exprs,
    metric_catalog,
    require_tool,
    run_tool,
)

DASHBOARD = DEPLOY / "grafana" / "tpflex-dashboard.json"
# Grafana's built-in interval variables, replaced by a duration so promtool can parse.
GRAFANA_INTERVALS = re.compile(r"\$(?:__rate_interval|__interval|__range)\b")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    return dashboard_panels(dash)


def _panel_exprs(dash: dict) -> list[str]:
    return dashboard_panel_exprs(dash)


def _all_exprs() -> list[str]:
    dash = _dashboard()
    return _panel_exprs(dash) + dashboard_variable_exprs(dash)


def test_dashboard_is_json_with_a_stable_uid_and_a_datasource_variable():
    dash = _dashboard()
    assert dash["uid"] == "tpflex-overview"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in _panels(dash):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_dashboard_shows_goodput_tp_degree_power_caps_and_reconfiguration_latency():
    used = set().union(*(analyse(e).metrics for e in _panel_exprs(_dashboard())))
    assert {
        "tpflex_job_expected_throughput_ratio",
        "tpflex_replica_tp_degree",
        "tpflex_gpu_power_cap_watts",
        "tpflex_reconfiguration_seconds_bucket",
        "tpflex_job_goodput_ratio",  # measured, next to the planned ratio
        "tpflex_rank_failures_total",
        "tpflex_plan_acked_generation",
        "tpflex_rack_domain_size",
    } <= used


def test_no_query_turns_a_missing_series_into_zero():
    """``or vector(0)`` made "Degraded racks" and "Plans not acked" read 0 while the series
    they compare were not exported at all: a missing series must show as no data."""
    for expr in _all_exprs():
        assert not re.search(r"\bor\s+vector\s*\(", expr), expr
        assert "absent" not in expr, expr


def test_the_goodput_panel_and_stats_show_measured_next_to_planned():
    by_title = {p["title"]: p for p in _panels(_dashboard())}
    stats = {t: analyse(p["targets"][0]["expr"]).metrics for t, p in by_title.items() if p["type"] == "stat"}
    assert stats["Measured goodput"] == {"tpflex_job_goodput_ratio"}
    assert stats["Planned throughput"] == {"tpflex_job_expected_throughput_ratio"}
    assert stats["Rank failures (1 h)"] == {"tpflex_rank_failures_total"}
    goodput = [p for p in by_title.values() if p["type"] == "timeseries"
               and {"tpflex_job_goodput_ratio", "tpflex_job_expected_throughput_ratio"}
               <= set().union(*(analyse(t["expr"]).metrics for t in p["targets"]))]
    assert len(goodput) == 1


def test_panels_do_not_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(_dashboard()):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("expr", _all_exprs())
def test_dashboard_expressions_use_documented_metrics_and_labels(expr):
    assert problems(expr, metric_catalog()) == []


def test_promtool_parses_every_dashboard_expression(tmp_path):
    """Each expression becomes a recording rule, so `promtool check rules` parses it."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(_all_exprs()):
        concrete = GRAFANA_INTERVALS.sub("5m", expr)
        concrete = re.sub(r"\$\{?\w+\}?", ".*", concrete)
        lines += [f"      - record: dashboard:expr_{i}", f"        expr: {json.dumps(concrete)}"]
    rules = tmp_path / "dashboard_rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    result = run_tool([require_tool("promtool"), "check", "rules", str(rules)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_all_exprs())} rules found" in result.stdout
