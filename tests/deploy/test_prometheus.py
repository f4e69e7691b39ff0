"""Prometheus scrape configuration and alert rules: promtool accepts them, the alert unit
tests pass, and every expression uses documented metric names and labels only."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.promql import problems, rule_exprs
from tests.deploy.tools import DEPLOY, REPO, metric_catalog, require_tool, run_tool

PROM = DEPLOY / "prometheus"
REQUIRED_ALERTS = {
    "TpflexRackDegradedTooLong",
    "TpflexGpuPowerLimitAboveCap",
    "TpflexPlanNotAcked",
    "TpflexControllerNoLeader",
    "TpflexJobGoodputLow",
    "TpflexRankFailuresFrequent",
}


def _promtool() -> str:
    return require_tool("promtool")


def _stage_etc_prometheus(dest: Path, certs: Path) -> Path:
    """The /etc/prometheus layout prometheus.yml expects (its header), under ``dest``."""
    (dest / "tpflex" / "agents").mkdir(parents=True)
    (dest / "tpflex" / "tls").mkdir()
    shutil.copy(PROM / "prometheus.yml", dest / "prometheus.yml")
    shutil.copy(PROM / "alerts.yml", dest / "tpflex" / "alerts.yml")
    shutil.copy(PROM / "targets" / "agents.yml", dest / "tpflex" / "agents" / "agents.yml")
    for name in ("ca.pem", "prometheus.pem", "prometheus-key.pem"):
        shutil.copy(certs / name, dest / "tpflex" / "tls" / name)
    return dest / "prometheus.yml"


def test_check_config_accepts_the_scrape_configuration(tmp_path, dev_certs):
    config = _stage_etc_prometheus(tmp_path, dev_certs)
    result = run_tool([_promtool(), "check", "config", str(config)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid prometheus config file syntax" in result.stdout


def test_check_config_refuses_a_missing_client_key(tmp_path, dev_certs):
    config = _stage_etc_prometheus(tmp_path, dev_certs)
    (tmp_path / "tpflex" / "tls" / "prometheus-key.pem").unlink()
    result = run_tool([_promtool(), "check", "config", str(config)], cwd=tmp_path)
    assert result.returncode != 0
    assert "prometheus-key.pem" in result.stdout + result.stderr


def test_check_rules_accepts_every_alert_and_the_reader_sees_them_all():
    result = run_tool([_promtool(), "check", "rules", str(PROM / "alerts.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    count = int(re.search(r"SUCCESS: (\d+) rules found", result.stdout).group(1))
    text = (PROM / "alerts.yml").read_text()
    assert len(rule_exprs(text)) == count
    assert REQUIRED_ALERTS <= set(re.findall(r"^\s*- alert: (\w+)", text, re.M))


def test_alert_unit_tests_pass():
    result = run_tool([_promtool(), "test", "rules", "alerts_test.yml"], cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("expr", rule_exprs((PROM / "alerts.yml").read_text()))
def test_alert_expressions_use_documented_metrics_and_labels(expr):
    assert problems(expr, metric_catalog()) == []


def test_docs_list_exactly_the_documented_metrics():
    documented = set(metric_catalog())
    doc = (REPO / "docs" / "deploy.md").read_text()
    in_docs = set(re.findall(r"^\|\s*`(tpflex_\w+)`", doc, re.M))
    assert in_docs == documented
    # and with the catalog's labels: the table said `job` where the exporter has
    # `training_job` (Prometheus's own `job` target label), so alerts written from it matched
    # nothing
    rows = re.findall(r"^\|\s*`(tpflex_\w+)`\s*\|\s*\w+\s*\|([^|]*)\|", doc, re.M)
    catalog = metric_catalog()
    for name, labels in rows:
        assert {x.strip() for x in labels.split(",") if x.strip()} == catalog[name].labels, name


def test_scrape_targets_use_the_ports_of_the_example_configs():
    controller = tomllib.loads((DEPLOY / "config" / "controller.toml").read_text())
    agent = tomllib.loads((DEPLOY / "config" / "agent.toml").read_text())
    rest_port = controller["rest"]["listen"].rsplit(":", 1)[1]
    metrics_port = agent["metrics"]["listen"].rsplit(":", 1)[1]
    config = (PROM / "prometheus.yml").read_text()
    controller_job = config.split("job_name: tpflex-controller", 1)[1].split("job_name:", 1)[0]
    assert set(re.findall(r'"[\w.-]+:(\d+)"', controller_job)) == {rest_port}
    agent_targets = (PROM / "targets" / "agents.yml").read_text()
    assert set(re.findall(r'"[\w.-]+:(\d+)"', agent_targets)) == {metrics_port}


def test_every_catalogued_metric_is_named_in_its_exporters_code():
    """Drift check: every metric the catalog lists is named in its exporter's code; none
    is "assumed" (used by an alert or panel with nothing exporting it: such an alert can
    never fire). test_prometheus_live.py checks the running stack exports each one."""
    code = REPO / "controller" / "tpflex_controller"
    sources = {
        "controller": [code / "metrics.py", code / "steps.py"],
        "agent": [REPO / "agent" / "tpflex_agent" / "metrics.py"],
    }
    catalog = tomllib.loads((PROM / "metrics.toml").read_text())["metric"]
    for metric in catalog:
        assert metric["status"] in {"issue-2", "issue-39", "agent"}, metric["name"]
        text = "".join(p.read_text() for p in sources[metric["exported_by"]])
        assert f'"{metric["name"]}"' in text, metric["name"]


def _alert_cases() -> dict[str, list[list]]:
    """alerts_test.yml: per alert name, the exp_alerts of each of its evaluations."""
    cases: dict[str, list[list]] = {}
    for test in yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    return cases


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_does_not():
    """Each alert's expression returns data for the condition it names (a case with
    expected alerts) and none outside it (a case without), as promtool evaluates them
    (test_alert_unit_tests_pass)."""
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    alerts = [r["alert"] for g in rules for r in g["rules"] if "alert" in r]
    cases = _alert_cases()
    for alert in alerts:
        assert any(cases.get(alert, [])), f"{alert}: no unit test in which it fires"
        assert any(not c for c in cases.get(alert, [])), f"{alert}: no unit test in which it stays silent"
    assert set(cases) <= set(alerts), f"unit tests of alerts that do not exist: {set(cases) - set(alerts)}"


def test_only_the_no_leader_alert_turns_a_missing_series_into_a_value():
    """``or vector(0)`` is allowed where absence must fire (no controller scraped at all is
    no leader), never where it would hide a series nothing exports."""
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    users = [r.get("alert") or r.get("record") for g in rules for r in g["rules"]
             if re.search(r"\bor\s+vector\s*\(", r["expr"])]
    assert users == ["TpflexControllerNoLeader"]


def test_scrape_config_needs_no_honor_labels_and_the_catalog_has_no_job_label():
    """The controller names the training job ``training_job``: Prometheus' own ``job``
    target label survives every scrape (no honor_labels), and no tpflex metric declares a
    label that a scrape would overwrite."""
    assert "honor_labels" not in (PROM / "prometheus.yml").read_text()
    catalog = tomllib.loads((PROM / "metrics.toml").read_text())["metric"]
    for m in catalog:
        assert not {"job", "instance"} & set(m["labels"]), m["name"]
    gpu_series = [m for m in catalog if m.get("exported_by") == "agent" and "gpu" in m["labels"]]
    assert gpu_series and all({"gpu", "UUID", "Hostname"} <= set(m["labels"]) for m in gpu_series)
