"""The Grafana dashboard: valid JSON, the panels the issue asks for, PromQL that promtool
parses and that uses documented metric names and labels only."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.promql import analyse, problems
from tests.deploy.tools import DEPLOY, metric_catalog, require_tool, run_tool

DASHBOARD = DEPLOY / "grafana" / "tpflex-dashboard.json"
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
# Grafana's built-in interval variables, replaced by a duration so promtool can parse.
GRAFANA_INTERVALS = re.compile(r"\$(?:__rate_interval|__interval|__range)\b")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    flat = []
    for panel in dash["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))
    return flat


def _panel_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]


def _variable_exprs(dash: dict) -> list[str]:
    exprs = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = LABEL_VALUES.match(query)
        assert match, f"variable {var['name']}: unsupported query {query!r}"
        exprs.append(f"max by ({match.group(2)}) ({match.group(1)})")
    return exprs


def _all_exprs() -> list[str]:
    dash = _dashboard()
    return _panel_exprs(dash) + _variable_exprs(dash)


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
    } <= used


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
