"""Component test (issue 40): the real tpflex-controller process (leader, REST child) on
a real etcd, driven over HTTP with named tokens: the operator's name reaches the plan the
leader commits (Plan.by), the event log (GET /v1/events), the console's decision list
(its stream's snapshot) and the audit trail in the controller's log; a read-only token's
refused drain is audited as denied under its name."""

from __future__ import annotations

import json

import httpx
from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import (
    ControllerProc,
    PlanWatcher,
    controller_on_job,
    put_job,
    small_cluster,
)
from tests.support.wait import wait_until

ALICE = "alice-0a1b2c3d4e5f"
VIEWER = "viewer-9f8e7d6c5b4a"
OTHER = "ops-x-13579bdf"


def _audit_lines(proc: ControllerProc) -> list[dict]:
    """The ``tpflex.audit`` records in the controller's output (its REST child's stderr
    is the controller's: one stream, the log file here, journald under systemd)."""
    out = []
    for line in proc.log_path.read_text().splitlines():
        head, sep, tail = line.partition(" tpflex.audit ")
        if sep:
            out.append(json.loads(tail))
    return out


def _console_snapshot(http: httpx.Client, token: str) -> dict:
    with http.stream("GET", "/v1/console/stream", headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name == "snapshot":
                return json.loads(line[6:])
    raise AssertionError("no snapshot")


def test_an_operators_name_reaches_plan_events_console_and_audit(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    (tmp_path / "admin.tokens").write_text(f"alice {ALICE}\nops-x {OTHER} jobs=x\n")
    (tmp_path / "readonly.tokens").write_text(f"viewer {VIEWER}\n")
    watcher = PlanWatcher(etcd, "job1")
    proc = ControllerProc(etcd_server.endpoints, "named1", tmp_path, extra=[
        "--admin-tokens-file", str(tmp_path / "admin.tokens"),
        "--readonly-tokens-file", str(tmp_path / "readonly.tokens"), "--log-level", "WARNING"])
    try:
        proc.wait_http()
        watcher.wait_generation(1, timeout=20)
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            wait_until(lambda: http.get("/readyz").status_code == 200, 10, "readyz 200")
            drain = "/v1/nodes/rack1-n00/gpus/1/drain"
            # refused: a read-only token, and an admin token limited to job x
            r = http.post(drain, json={"reason": "x"}, headers={"Authorization": f"Bearer {VIEWER}"})
            assert r.status_code == 403, r.text
            r = http.post("/v1/jobs/job1/reconfigure", json={"policy": "ntp", "reason": "try"},
                          headers={"Authorization": f"Bearer {OTHER}"})
            assert r.status_code == 403 and "limited to jobs x" in r.json()["error"]["message"]
            assert watcher.latest().generation == 1

            r = http.post(drain, json={"reason": "flaky NVLink"},
                          headers={"Authorization": f"Bearer {ALICE}", "X-Request-Id": "chg-2041"})
            assert r.status_code == 202, r.text
            assert r.headers["X-Request-Id"] == "chg-2041"
            plan = watcher.wait_generation(2, timeout=20)
            assert (plan.by, plan.cause) == ("alice", "drain"), [(p.generation, p.cause, p.by) for p in watcher.plans]
            # the REST process's view follows etcd: wait for it to hold generation 2
            view = wait_until(lambda: (v := http.get("/v1/jobs/job1/plan").json())["generation"] == 2 and v,
                              10, "the API's view of generation 2")
            assert view["by"] == "alice"
            assert http.get("/v1/jobs/job1").json()["plan"]["by"] == "alice"

            def committed() -> dict | None:
                events = http.get("/v1/events", params={"job": "job1"}).json()["events"]
                return next((e for e in events if e["generation"] == 2 and e["kind"] == "plan_committed"), None)

            event = wait_until(committed, 10, "the generation-2 event")
            assert event["by"] == "alice" and event["cause"] == "drain"
            assert event["reasons"][0] == "drain rack1-n00:1 by alice: flaky NVLink"
            # the console's decision list is fed by its stream: the same event, with "by"
            snap = _console_snapshot(http, VIEWER)
            [shown] = [e for e in snap["events"] if e["seq"] == event["seq"]]
            assert shown["by"] == "alice" and shown["reasons"][0] == event["reasons"][0]
            # the generation-1 event names nobody (no operator caused it)
            first = [e for e in snap["events"] if e["generation"] == 1]
            assert first and all(e["by"] == "" for e in first)

        # the audit trail, in the controller's log even at log_level WARNING
        records = wait_until(lambda: (a := _audit_lines(proc)) and len(a) >= 3 and a, 10, "3 audit lines")
        assert [(a["who"], a["outcome"], a["status"]) for a in records] == [
            ("viewer", "denied", 403), ("ops-x", "denied", 403), ("alice", "ok", 202)]
        ok = records[2]
        assert ok["what"] == "POST /v1/nodes/{node}/gpus/{index}/drain" and ok["target"] == drain
        assert ok["request_id"] == "chg-2041" and ok["reason"] == "flaky NVLink"
        assert records[1]["what"] == "POST /v1/jobs/{job}/reconfigure"
        log = proc.log_path.read_text()
        assert ALICE not in log and VIEWER not in log and OTHER not in log  # no token logged
        assert proc.terminate() == 0
    finally:
        watcher.close()
        proc.kill()


# ---- the leader alone (in-process controller): which operator a decision names ----


def _events(etcd) -> list[types_pb2.Event]:
    kvs, _ = etcd.get_prefix(keys.EVENTS)
    return [codec.decode(types_pb2.Event, kv.value) for kv in kvs]


def _drain(etcd, node: str, index: int, by: str, reason: str) -> None:
    etcd.put(keys.gpu_override(node, index), codec.encode(types_pb2.GpuOverride(
        gpu=types_pb2.GpuRef(node=node, index=index), drained=True, reason=reason, by=by)))


def test_the_leader_names_the_operators_of_a_decision_and_nobody_otherwise(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (_, watcher, _ctl):
        watcher.wait_generation(1, timeout=20)
        _drain(etcd, "rack1-n00", 1, "alice", "flaky NVLink")
        gen2 = watcher.wait_generation(2)
        assert (gen2.by, gen2.cause) == ("alice", "drain")
        # a job override by another operator: its name and reason
        etcd.put(keys.job_override("job1"), codec.encode(types_pb2.JobOverride(
            job="job1", pins=[types_pb2.ReplicaPin(replica=0, tp_degree=3)], reason="test TP 3",
            by="bob")))
        gen3 = watcher.wait_generation(3)
        assert (gen3.by, gen3.cause) == ("bob", "override")
        # a full undrain deletes the override: the decision names nobody
        etcd.delete(keys.gpu_override("rack1-n00", 1))
        gen4 = watcher.wait_generation(4)
        assert (gen4.by, gen4.cause) == ("", "undrain")

        def committed() -> dict[int, types_pb2.Event]:
            found = {e.generation: e for e in _events(etcd) if e.kind == "plan_committed"}
            return found if len(found) >= 4 else {}

        events = wait_until(committed, 10, "4 plan events")
        assert events[1].by == "" and events[4].by == ""
        assert events[2].by == "alice" and events[2].reasons[0] == "drain rack1-n00:1 by alice: flaky NVLink"
        assert events[3].by == "bob" and events[3].reasons[0] == "override of job job1 by bob: test TP 3"
        assert not any("by " in r for r in events[4].reasons)
