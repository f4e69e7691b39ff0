"""Day one on a cluster (issue 39 part 6), the way docs/deploy.md's "Day one" walkthrough
does it, with real processes only: etcd with TLS and user/password auth, two
``tpflex-controller`` replicas, two ``tpflex-agent`` processes on the NVML backend over
the fake libnvidia-ml (node gpu-0's GPUs report max power limit = default = 700 W, as on
H100 SXM boards; gpu-1's have headroom up to 1000 W), a real Prometheus with the shipped
prometheus.yml and alerts.yml.

The operator onboards only through ``tpflexctl`` and the REST API: ``racks propose``
prints the inventory from what the agents registered (both nodes unassigned until then),
the operator fills in the power budgets, ``racks apply`` writes it (refused while a
placeholder is left); ``tpflexctl job-spec --model DIR`` derives the job spec from a tiny
Hugging Face model directory, one ``tpflex-run`` per node starts the ranks over TLS (the
demo's worker training that model), which register the job; ``tpflexctl set-spec`` with
the same spec changes nothing. After a few steps a GPU of gpu-0 fails (XID 79 from the
fake driver): the plan runs that replica as plain NTP with the reason "no power
headroom". The operator drains a GPU of gpu-1: that replica is boosted above its default
limit and the agent enforces it. ``racks apply --dry-run`` with a lower budget for
gpu-1's rack prints the cap changes and writes nothing. The survivors train on in the new
layout. Every metric name that the alert rules and the dashboard use is then in
Prometheus, scraped from this stack (the test prints them), and the degraded racks'
alert expression returns both racks.

Nothing in this file writes to etcd (no rack record, job spec or plan is written from
Python: issue 39 checks that with a grep); it reads one key's revision to show that a dry
run wrote nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tpflex_proto import keys

from tests.deploy.promql import rule_exprs
from tests.deploy.tools import (
    DEPLOY,
    assert_used_metrics_exported,
    make_certs,
    require_tool,
)
from tests.e2e.day_one_support import RUN, Cluster, query, stage_prometheus
from tests.launch.support import base_env
from tests.security.stack import PASSWORDS, Proc, start_secure_etcd, write_secrets
from tests.support.ports import free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

JOB = "day-one"
GPUS = 4
NODES = {"gpu-0": ("rack-0", 700_000), "gpu-1": ("rack-1", 1_000_000)}  # node: (rack, max limit mW)
BUDGETS = {"rack-0": 2800, "rack-1": 3640}  # W: all GPUs at TDP; 1.3 x that
FAILED_GPU = 1  # on gpu-0: rank 1 of the job
DRAINED_GPU = 3  # on gpu-1: rank 7
LOWER_BUDGET = 2400  # W: rack-1 in the dry run
STEPS = 6
HOLD_STEP = 3


def _ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout


def _tiny_llama(dest: Path) -> Path:
    """A Hugging Face model directory, as save_pretrained writes it: Llama with 8 query
    heads over 4 KV heads (tests/controller/test_jobspec_from_model.py's)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    return dest


def _records(path: Path) -> list[dict]:
    out = []
    for f in path.parent.glob(path.name):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return out



def _alerts() -> dict[str, str]:
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    names = re.findall(r"^\s*- alert: (\w+)", text, re.MULTILINE)
    exprs = rule_exprs(text)
    assert len(names) == len(exprs) > 0
    return dict(zip(names, exprs, strict=True))


@pytest.fixture
def cluster(tmp_path):
    certs = tmp_path / "certs"
    made = make_certs(certs)
    assert made.returncode == 0, made.stderr
    etcd = start_secure_etcd(certs, tmp_path)
    c = Cluster(certs, tmp_path, etcd)
    try:
        etcd.enable_auth()
        write_secrets(tmp_path / "secrets")
        c.start_controller("ctl-1")
        c.start_controller("ctl-2")
        for node, (rack, max_mw) in NODES.items():
            c.start_agent(node, rack, GPUS, max_mw)
        yield c
    finally:
        c.stop()


def test_day_one_from_an_empty_etcd_to_a_job_that_survives_a_gpu_failure(cluster, tmp_path):
    prometheus = require_tool("prometheus", "/usr/bin/prometheus")
    c = cluster
    prom_port = free_port()
    prom = Proc([prometheus, f"--config.file={stage_prometheus(tmp_path / 'etc-prometheus', c)}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                 "--log.level=warn"])
    c.others.append(prom)
    prom_url = f"http://127.0.0.1:{prom_port}"

    # ---- the agents registered; no rack has a record: both nodes unassigned ----
    def unassigned() -> dict[str, str]:
        status = json.loads(_ok(c.tpflexctl("--json", "status")))
        return {n["node"]: n["reason"] for n in status.get("unassigned_nodes", [])}
    wait_until(lambda: sorted(unassigned()) == sorted(NODES), 30, "both nodes registered and unassigned")
    assert unassigned() == {node: f"no rack record '{rack}'" for node, (rack, _) in NODES.items()}

    # ---- racks propose -> the operator fills in the budgets -> racks apply ----
    proposal = _ok(c.tpflexctl("racks", "propose"))
    print(f"\n$ tpflexctl racks propose\n{proposal}")
    proposed = yaml.safe_load(proposal)["racks"]
    assert [(r["name"], r["nodes"], r["gpus_per_node"], r["domain_size"]) for r in proposed] == [
        (rack, [node], GPUS, GPUS) for node, (rack, _) in NODES.items()]
    # the limits the GPUs reported: no headroom on gpu-0, up to 1000 W on gpu-1
    assert [(r["gpu_tdp_w"], r["gpu_max_w"], r["gpu_min_w"]) for r in proposed] == [(700, 700, 200), (700, 1000, 200)]
    assert all(r["power_budget_w"] == "FILL-ME" for r in proposed)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(proposal)
    refused = c.tpflexctl("racks", "apply", "-f", str(inventory), admin=True)
    assert refused.returncode == 2 and "FILL-ME" in refused.stderr, refused.stderr
    for r in proposed:
        r["power_budget_w"] = BUDGETS[r["name"]]
    inventory.write_text(yaml.safe_dump({"racks": proposed}, sort_keys=False))
    applied = _ok(c.tpflexctl("racks", "apply", "-f", str(inventory), admin=True))
    assert "rack rack-0: created" in applied and "rack rack-1: created" in applied, applied
    assert applied.splitlines()[-1] == "applied: 2 created", applied
    with c.http() as http:
        racks = {r["name"]: r for r in http.get("/v1/racks").json()}
    assert {n: r["power_budget_w"] for n, r in racks.items()} == BUDGETS
    wait_until(lambda: unassigned() == {}, 10, "no node unassigned once the racks exist")

    # ---- the job spec from the model directory ----
    model = _tiny_llama(tmp_path / "llama")
    alloc = ["--name", JOB, "--nodes", " ".join(NODES), "--gpus-per-node", str(GPUS),
             "--rack-pattern", "rack-{domain}", "--local-batch", "8", "--min-tp", "2"]
    spec_file = tmp_path / "job.json"
    spec_file.write_text(_ok(c.tpflexctl("job-spec", "--model", str(model), *alloc, timeout=180)))
    spec = json.loads(spec_file.read_text())
    assert {u["name"]: u["count"] for u in spec["units"]} == {"attn": 4, "vocab": 16, "ffn": 16}
    assert [st["rack"] for r in spec["replicas"] for st in r["stages"]] == ["rack-0", "rack-1"]
    rest_spec = tmp_path / "job-rest.json"
    rest_spec.write_text(_ok(c.tpflexctl("job-spec", "--model", str(model), *alloc, "--format", "rest",
                                         "--no-self-test", timeout=180)))

    # ---- one tpflex-run per node registers the job (admin token), its ranks train ----
    hold = tmp_path / "hold"
    hold.write_text(f"{HOLD_STEP} 1000000\n")  # the ranks wait before step 3 until released
    out = tmp_path / "steps.jsonl"
    env = base_env(TPFLEX_DEMO_OUT=str(out), TPFLEX_DEMO_MODEL=str(model), TPFLEX_DEMO_STEPS=str(STEPS),
                   TPFLEX_DEMO_HOLD_FILE=str(hold), GLOO_SOCKET_IFNAME="lo", TPFLEX_LOG_LEVEL="WARNING",
                   TPFLEX_PLAN_WAIT_S="120")
    from tpflex_trainer.demo.launcher import worker_preload

    launchers, logs = [], []
    try:
        for node in NODES:
            logs.append(open(tmp_path / f"run-{node}.log", "wb"))  # noqa: SIM115 (closed below)
            launchers.append(subprocess.Popen(
                [RUN, "--controller", c.trainer_endpoints, "--job-spec", str(spec_file), "--node", node,
                 "--tls-ca", str(c.certs / "ca.pem"), "--log-dir", str(tmp_path / "logs"),
                 # the operator's admin token: tpflex-run registers the job with it and hands
                 # its ranks the job credential it is issued (docs/launch.md)
                 "--register-token-file", str(c.base / "secrets" / "admin.tokens"),
                 "--preload", ",".join(worker_preload(model)), "--",
                 sys.executable, "-m", "tpflex_trainer.demo.worker"],
                env=env, stdout=subprocess.DEVNULL, stderr=logs[-1],
                start_new_session=True))

        def steps_done(step: int, ranks) -> bool:
            for p in launchers:
                assert p.poll() is None, f"tpflex-run exited {p.returncode}: {_logs(tmp_path)}"
            done = {r["rank"] for r in _records(out) if r["kind"] == "step" and r["step"] >= step}
            return set(ranks) <= done
        wait_until(lambda: steps_done(HOLD_STEP - 1, range(2 * GPUS)), 150,
                   f"every rank's step {HOLD_STEP - 1}", interval=0.2,
                   fail=lambda: AssertionError(f"ranks did not train: {_logs(tmp_path)}"))

        jobs = json.loads(_ok(c.tpflexctl("--json", "jobs")))
        assert [(j["name"], j["plan"]["generation"]) for j in jobs] == [(JOB, 1)], jobs
        # the operator's REST path for the spec: the same spec again changes nothing
        same = _ok(c.tpflexctl("set-spec", JOB, "--file", str(rest_spec), admin=True))
        assert same.startswith(f"job {JOB}: spec unchanged"), same

        # ---- XID 79 on gpu-0, whose GPUs have no power headroom ----
        gpu0 = next(a for a in c.agents if a.node == "gpu-0")
        gpu0.fake.xid(FAILED_GPU, 79, lost=1)

        def plan_after(generation: int):
            plan = json.loads(_ok(c.tpflexctl("--json", "plan", JOB)))
            return plan if plan["generation"] > generation else None
        plan = wait_until(lambda: plan_after(1), 30, "the plan without gpu-0:1", interval=0.2)
        print(f"$ tpflexctl plan {JOB}\n{_ok(c.tpflexctl('plan', JOB))}")
        r0, r1 = plan["replicas"]
        reason = "NTP (no power headroom: gpu-0 GPUs max limit = default 700 W)"
        assert r0["state"] == "degraded" and r0["tp_degree"] == 3 and r0["local_batch"] == 6, r0
        assert reason in r0["reason"] and any(reason in line for line in plan["reasons"]), plan
        assert r1["state"] == "healthy" and r1["tp_degree"] == 4 and "no power headroom" not in r1["reason"]
        assert all(cap["cap_w"] <= 700 for cap in plan["power_caps"] if cap["node"] == "gpu-0"), plan

        # ---- the operator drains a GPU of gpu-1 (headroom): that replica is boosted ----
        drained = _ok(c.tpflexctl("drain", "gpu-1", str(DRAINED_GPU), "--reason", "day one: fan noise",
                                  admin=True))
        assert drained.startswith(f"drained GPU gpu-1:{DRAINED_GPU}"), drained
        plan = wait_until(lambda: plan_after(plan["generation"]), 30, "the plan without gpu-1:3", interval=0.2)
        print(f"$ tpflexctl plan {JOB}\n{_ok(c.tpflexctl('plan', JOB))}")
        r0, r1 = plan["replicas"]
        assert reason in r0["reason"] and r0["local_batch"] == 6, r0
        # boosted above its default limit (the boost falls short of TP 4's speed: batch 6 of 8)
        assert r1["state"] == "degraded" and r1["tp_degree"] == 3 and "no power headroom" not in r1["reason"], r1
        assert any(line.startswith("replica 1: ") and "boosted to" in line for line in plan["reasons"]), plan
        boost = [cap["cap_w"] for cap in plan["power_caps"] if cap["node"] == "gpu-1"]
        assert len(boost) == 3 and all(700 < w <= 1000 for w in boost), plan["power_caps"]

        # ---- a dry run on a lower budget: the plan changes printed, nothing written ----
        etcd = c.etcd.client(user="tpflex-controller", password=PASSWORDS["tpflex-controller"])
        try:
            before = etcd.get(keys.rack("rack-1")).mod_revision
            with c.http() as http:
                racks_before = http.get("/v1/racks").json()
            lower = [{**r, "power_budget_w": LOWER_BUDGET} if r["name"] == "rack-1" else r for r in proposed]
            changed = tmp_path / "inventory-lower.yaml"
            changed.write_text(yaml.safe_dump({"racks": lower}, sort_keys=False))
            dry = _ok(c.tpflexctl("racks", "apply", "-f", str(changed), "--dry-run", admin=True))
            print(f"$ tpflexctl racks apply -f inventory-lower.yaml --dry-run\n{dry}")
            assert "rack rack-1: changed" in dry and f"power_budget_w: 3640 -> {LOWER_BUDGET}" in dry, dry
            assert f"job {JOB}: its next plan is recomputed" in dry and "the next plan is the same" not in dry, dry
            # the boosted GPUs' caps shrink to the lower budget over its 3 usable GPUs
            cap = f"power cap {boost[0]:.0f} W -> {LOWER_BUDGET / 3:.0f} W: gpu-1:0, gpu-1:1, gpu-1:2"
            assert f"    {cap}" in dry.splitlines(), dry
            assert "rack rack-0: unchanged" in dry, dry
            assert dry.splitlines()[-1] == "dry run: nothing written: 1 changed, 1 unchanged", dry
            assert etcd.get(keys.rack("rack-1")).mod_revision == before
            with c.http() as http:
                assert http.get("/v1/racks").json() == racks_before
            assert plan_after(plan["generation"]) is None  # no new plan either
        finally:
            etcd.close()

        # the agents enforce it (as Prometheus scraped them): gpu-1's three GPUs boosted, gpu-0 at most TDP
        def limits(node: str) -> dict[str, float]:
            return {r["metric"]["gpu"]: float(r["value"][1])
                    for r in query(prom_url, f'tpflex_gpu_power_limit_watts{{node="{node}"}}', prom)}
        wait_until(lambda: limits("gpu-1") == {"0": boost[0], "1": boost[0], "2": boost[0], "3": 700.0}, 30,
                   "gpu-1's boosted limits in Prometheus", interval=0.5,
                   fail=lambda: AssertionError(f"gpu-1 limits: {limits('gpu-1')}, plan: {boost}"))
        assert limits("gpu-0") and all(w <= 700 for w in limits("gpu-0").values()), limits("gpu-0")

        # the survivors train on in the new layout
        hold.unlink()
        survivors = [r for r in range(2 * GPUS) if r not in (FAILED_GPU, GPUS + DRAINED_GPU)]
        wait_until(lambda: steps_done(STEPS - 1, survivors), 120, f"the survivors' step {STEPS - 1}",
                   interval=0.2, fail=lambda: AssertionError(f"survivors stuck: {_logs(tmp_path)}"))
        after = [r for r in _records(out) if r["kind"] == "step" and r["step"] >= HOLD_STEP]
        assert {r["generation"] for r in after} == {plan["generation"]}
        assert {r["rank"] for r in after} == set(survivors)
        assert {r["global_batch"] for r in after} == {r0["local_batch"] + r1["local_batch"]}

        # ---- the alert rules against what this stack exported ----
        assert_used_metrics_exported(prom_url, prom, 60)
        alerts = _alerts()
        degraded = wait_until(lambda: len(query(prom_url, alerts["TpflexRackDegradedTooLong"], prom)) == 2 and query(prom_url, alerts["TpflexRackDegradedTooLong"], prom), 30,
                              "TpflexRackDegradedTooLong's expression returning both racks", interval=0.5)
        assert sorted((r["metric"]["rack"], r["value"][1]) for r in degraded) == [("rack-0", "1"), ("rack-1", "1")]
        for expr in alerts.values():  # every rule evaluates on this data (no error)
            query(prom_url, expr, prom)
        up = query(prom_url, 'count by (job) (up{job=~"tpflex-.*|etcd"} == 1)', prom)
        assert {r["metric"]["job"]: r["value"][1] for r in up} == {"tpflex-controller": "2", "tpflex-agent": "2",
                                                                    "etcd": "1"}, up
        leaders = query(prom_url, "sum(tpflex_controller_is_leader)", prom)
        assert [r["value"][1] for r in leaders] == ["1"]  # one of the two replicas leads
    finally:
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in logs:
            f.close()


def _logs(tmp: Path) -> str:
    parts = []
    for f in sorted([*tmp.glob("run-*.log"), *(tmp / "logs").glob("*.log")]):
        parts.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-1500:])
    return "\n".join(parts)[-8000:]
