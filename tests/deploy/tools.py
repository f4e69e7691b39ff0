"""Helpers for the deploy artifact tests: repository paths, tools, development certs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CERTS_SCRIPT = DEPLOY / "certs" / "make-dev-certs.sh"


def require_tool(name: str, path: str | None = None) -> str:
    """Absolute path of a command-line tool, or skip the test naming the missing package."""
    found = shutil.which(name) or (path if path and Path(path).exists() else None)
    if not found:
        pytest.skip(f"{name} not installed (Debian packages: systemd, prometheus, openssl, etcd-server)")
    return found


def run_tool(args: list[str], cwd: Path | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def make_certs(out: Path, extra_sans: str = "") -> subprocess.CompletedProcess:
    """Run deploy/certs/make-dev-certs.sh into ``out``."""
    require_tool("openssl")
    env = {"PATH": "/usr/bin:/bin", "TPFLEX_CERT_SANS": extra_sans}
    return subprocess.run(
        ["bash", str(CERTS_SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=60
    )


def metric_catalog() -> dict:
    """deploy/prometheus/metrics.toml as {name: MetricSpec}."""
    import tomllib

    from tests.deploy.promql import MetricSpec

    data = tomllib.loads((DEPLOY / "prometheus" / "metrics.toml").read_text())
    return {
        m["name"]: MetricSpec(m["name"], m["type"], frozenset(m["labels"])) for m in data["metric"]
    }


SECRET_FILES = {
    "secrets/etcd-controller.password": "dev-password\n",
    "secrets/etcd-agent.password": "dev-password\n",
    "secrets/admin.tokens": "# admin tokens\ndev-admin-token\n",
    "secrets/readonly.tokens": "dev-readonly-token\n",
}


def stage_etc_tpflex(dest: Path, certs: Path) -> Path:
    """A stand-in for /etc/tpflex: the example configs with their paths pointed at ``dest``,
    the development certificates under tls/ and dummy secret files under secrets/."""
    shutil.copytree(certs, dest / "tls")
    for rel, content in SECRET_FILES.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(content)
    for name in ("controller.toml", "agent.toml"):
        text = (DEPLOY / "config" / name).read_text()
        (dest / name).write_text(text.replace("/etc/tpflex/", f"{dest}/"))
    return dest


GRAFANA = DEPLOY / "grafana"
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")


def dashboard_panels(dash: dict) -> list[dict]:
    """A dashboard's panels, those inside rows included."""
    flat = []
    for panel in dash["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))
    return flat


def dashboard_panel_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dashboard_panels(dash) for t in p.get("targets", [])]


def dashboard_variable_exprs(dash: dict) -> list[str]:
    """Each query variable's ``label_values(expr, label)`` as ``max by (label) (expr)``."""
    exprs = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = _LABEL_VALUES.match(query)
        assert match, f"variable {var['name']}: unsupported query {query!r}"
        exprs.append(f"max by ({match.group(2)}) ({match.group(1)})")
    return exprs


def dashboard_exprs() -> list[str]:
    """Every PromQL query of every dashboard in deploy/grafana/ (panels, then variables)."""
    out = []
    for path in sorted(GRAFANA.glob("*.json")):
        dash = json.loads(path.read_text())
        out += dashboard_panel_exprs(dash) + dashboard_variable_exprs(dash)
    return out


def used_metric_names() -> list[str]:
    """Every metric name in the rule files of deploy/prometheus/ (alerts and recording
    rules) and in the queries (panels and variables) of the dashboards in deploy/grafana/."""
    import yaml

    from tests.deploy.promql import analyse, rule_exprs

    exprs = []
    for path in sorted((DEPLOY / "prometheus").glob("*.yml")):
        if "groups" in (yaml.safe_load(path.read_text()) or {}):
            exprs += rule_exprs(path.read_text())
    assert exprs and dashboard_exprs()
    return sorted(set().union(*(analyse(e).metrics for e in exprs + dashboard_exprs())))


def prom_query(url: str, expr: str, proc) -> list[dict]:
    """An instant query through Prometheus' HTTP API ([] while it is starting); ``proc``
    (a tests.security.stack.Proc) is Prometheus, which must still be running."""
    import httpx

    assert proc.proc.poll() is None, f"prometheus exited: {proc.output()[-2000:]}"
    try:
        r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=3)
    except httpx.HTTPError:
        return []  # not listening yet
    if r.status_code == 503:
        return []  # listening, still starting up ("Service Unavailable", not JSON)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def assert_used_metrics_exported(url: str, proc, timeout_s: float) -> list[str]:
    """Wait until Prometheus holds every metric name the shipped rules and dashboards use
    (printing the list it checks); fails naming the ones the stack does not export."""
    from tests.support.wait import wait_until

    used = used_metric_names()
    print(f"\nmetric names used by deploy/prometheus/*.yml and deploy/grafana/*.json ({len(used)}):")
    print("\n".join(f"  {name}" for name in used))
    pattern = "|".join(used)

    def missing() -> list[str]:
        found = prom_query(url, f'count by (__name__) ({{__name__=~"{pattern}"}})', proc)
        return sorted(set(used) - {r["metric"]["__name__"] for r in found})
    wait_until(lambda: not missing(), timeout_s, "every used metric name in Prometheus", interval=0.5,
               fail=lambda: AssertionError(f"not exported by the live stack: {missing()}"))
    print(f"every one exported by the live stack: {', '.join(used)}")
    return used
