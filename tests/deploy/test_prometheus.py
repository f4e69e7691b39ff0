"""Prometheus scrape configuration and alert rules: promtool accepts them, the alert unit
tests pass, and every expression uses documented metric names and labels only."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest

from tests.deploy.promql import problems, rule_exprs
from tests.deploy.tools import DEPLOY, REPO, metric_catalog, require_tool, run_tool

PROM = DEPLOY / "prometheus"
REQUIRED_ALERTS = {
    "TpflexRackDegradedTooLong",
    "TpflexGpuPowerLimitAboveCap",
    "TpflexPlanNotAcked",
    "TpflexControllerNoLeader",
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


def test_metrics_marked_as_exported_are_in_the_service_code():
    """Drift check: a metric the catalog calls exported is named in its exporter's code;
    "assumed" ones are the requests to the controller listed in docs/deploy.md."""
    sources = {
        "controller": REPO / "controller" / "tpflex_controller" / "metrics.py",
        "agent": REPO / "agent" / "tpflex_agent" / "metrics.py",
    }
    catalog = tomllib.loads((PROM / "metrics.toml").read_text())["metric"]
    for metric in catalog:
        assert metric["status"] in {"issue-2", "agent", "assumed"}, metric["name"]
        if metric["status"] != "assumed":
            assert f'"{metric["name"]}"' in sources[metric["exported_by"]].read_text(), metric["name"]


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
