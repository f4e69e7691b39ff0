"""REST API reads against a real etcd and a real uvicorn: racks, nodes, GPUs, jobs, plans,
events, status, probes, metrics, OpenAPI; malformed stored values are skipped."""

from __future__ import annotations

import pytest
from tpflex_controller.api import views
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h
from tests.support.rest import rest_error


def _error(resp, status: int) -> str:
    return rest_error(resp, status)["message"]


def test_probes_metrics_and_openapi(api):
    assert api.http.get("/healthz").json() == {"status": "ok", "detail": "", "leader": None}
    ready = api.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["leader"] == "ctl-1"
    metrics = api.http.get("/metrics")
    assert metrics.status_code == 200 and "tpflex_test_marker 7.0" in metrics.text
    paths = api.http.get("/openapi.json").json()["paths"]
    for p in ("/v1/racks", "/v1/nodes/{node}/gpus/{index}/drain", "/v1/jobs/{job}/dry-run",
              "/v1/jobs/{job}/reconfigure", "/v1/events", "/readyz"):
        assert p in paths
    api.etcd.delete(keys.LEADER)
    assert "no controller leader" in _error(api.http.get("/readyz"), 503)


def test_racks_list_and_detail(api):
    racks = api.http.get("/v1/racks").json()
    assert [r["name"] for r in racks] == list(h.RACKS)
    assert racks[0]["gpus"] == {"total": h.T, "healthy": h.T, "degraded": 0, "failed": 0, "drained": 0}
    detail = api.http.get("/v1/racks/rack-b").json()
    assert detail["nodes"] == ["rack-b-n0", "rack-b-n1"] and len(detail["gpu_list"]) == h.T
    assert "rack 'nope' not found" in _error(api.http.get("/v1/racks/nope"), 404)


def test_gpu_health_merges_registration_health_and_lease(api):
    h.put_health(api.store, "rack-a-n0", {2: (types_pb2.GPU_FAILED, "xid 79: fallen off the bus"),
                                          3: (types_pb2.GPU_DEGRADED, "thermal throttle")})
    api.etcd.delete(keys.node("rack-b-n1"))  # its lease lapsed
    gpus = {(g["node"], g["index"]): g for g in api.http.get("/v1/gpus").json()}
    assert len(gpus) == 2 * h.T
    assert gpus[("rack-a-n0", 2)]["state"] == "failed"
    assert "xid 79" in gpus[("rack-a-n0", 2)]["reason"]
    assert gpus[("rack-a-n0", 3)]["state"] == "degraded"
    assert gpus[("rack-a-n0", 0)]["uuid"] == "GPU-rack-a-n0-0"
    lapsed = gpus[("rack-b-n1", 1)]
    assert lapsed["state"] == "failed" and not lapsed["node_live"] and "lease" in lapsed["reason"]
    failed = api.http.get("/v1/gpus", params={"state": "failed"}).json()
    assert {(g["node"], g["index"]) for g in failed} == {("rack-a-n0", 2)} | {("rack-b-n1", i) for i in range(4)}
    one = api.http.get("/v1/nodes/rack-a-n0/gpus/3").json()
    assert one["state"] == "degraded" and one["rack"] == "rack-a"
    assert "not found" in _error(api.http.get("/v1/nodes/rack-a-n0/gpus/9"), 404)
    _error(api.http.get("/v1/gpus", params={"state": "sleepy"}), 422)


def test_nodes_list_and_detail(api):
    api.etcd.delete(keys.node("rack-a-n1"))
    nodes = {n["name"]: n for n in api.http.get("/v1/nodes").json()}
    assert set(nodes) == {h.node_name(r, i) for r in h.RACKS for i in range(2)}
    assert nodes["rack-a-n0"]["live"] and nodes["rack-a-n0"]["backend"] == "sim"
    assert not nodes["rack-a-n1"]["live"] and nodes["rack-a-n1"]["gpus"]["failed"] == 4
    detail = api.http.get("/v1/nodes/rack-a-n0").json()
    assert [g["index"] for g in detail["gpu_list"]] == [0, 1, 2, 3]
    assert "node 'ghost' not found" in _error(api.http.get("/v1/nodes/ghost"), 404)


def test_jobs_plan_and_history(api):
    jobs = api.http.get("/v1/jobs").json()
    assert [j["name"] for j in jobs] == [h.JOB]
    job = api.http.get(f"/v1/jobs/{h.JOB}").json()
    assert job["base_tp"] == h.T and job["replicas"] == 2 and job["min_tp"] == 4
    store = Store(api.etcd)  # the page is the JobView model of what etcd holds, every field
    reference = views.job_view(store.job(h.JOB), store.plan(h.JOB), store.job_override(h.JOB), store.acks(h.JOB))
    assert job == reference.model_dump(mode="json") == next(j for j in jobs if j["name"] == h.JOB)
    assert job["plan"]["generation"] == 1 and job["plan"]["replica_tp_degrees"] == [h.T, h.T]
    assert job["acked_current"] == 2 and [a["rank"] for a in job["acks"]] == [0, 1]
    plan = api.http.get(f"/v1/jobs/{h.JOB}/plan").json()
    assert plan["generation"] == 1 and plan["policy"] == api.plan.policy
    assert plan["expected_throughput_ratio"] == pytest.approx(api.plan.expected_throughput_ratio)
    assert [len(r["stages"][0]["gpus"]) for r in plan["replicas"]] == [h.T, h.T]
    second = types_pb2.Plan()
    second.CopyFrom(api.plan)
    second.generation, second.cause = 2, "gpu failed"
    api.etcd.put(keys.job_plan_history(h.JOB, 2), codec.encode(second))
    history = api.http.get(f"/v1/jobs/{h.JOB}/plans").json()
    assert [p["generation"] for p in history["plans"]] == [1, 2]
    last = api.http.get(f"/v1/jobs/{h.JOB}/plans", params={"limit": 1}).json()
    assert [p["generation"] for p in last["plans"]] == [2]
    assert "job 'nope' not found" in _error(api.http.get("/v1/jobs/nope"), 404)
    _error(api.http.get("/v1/jobs/nope/plan"), 404)
    api.etcd.delete(keys.job_plan(h.JOB))
    assert "no committed plan" in _error(api.http.get(f"/v1/jobs/{h.JOB}/plan"), 404)


def test_events_are_bounded(api):
    events = api.http.get("/v1/events").json()["events"]
    assert [e["seq"] for e in events] == [1, 2, 3]
    assert [e["seq"] for e in api.http.get("/v1/events", params={"limit": 2}).json()["events"]] == [2, 3]
    assert api.http.get("/v1/events", params={"job": "other"}).json()["events"] == []
    assert "limit" in _error(api.http.get("/v1/events", params={"limit": 0}), 422)
    _error(api.http.get("/v1/events", params={"limit": 100_000}), 422)
    _error(api.http.get("/v1/events", params={"limit": "many"}), 422)


def test_status_summary(api):
    st = api.http.get("/v1/status").json()
    assert st["leader"]["id"] == "ctl-1" and st["racks"] == 2 and st["live_nodes"] == 4
    assert st["gpus"]["total"] == 2 * h.T and st["gpus"]["healthy"] == 2 * h.T
    assert st["jobs"][0]["generation"] == 1 and st["etcd_revision"] > 0
    assert views.s.StatusView.model_validate(st).model_dump(mode="json") == st  # the documented schema, whole
    assert st["jobs"][0]["replica_tp_degrees"] == [h.T, h.T] and st["jobs"][0]["name"] == h.JOB


def test_malformed_values_in_etcd_are_skipped(api):
    api.etcd.put(keys.health("rack-a-n0"), b"\xff\x00garbage")
    api.etcd.put(keys.rack("rack-z"), b"not a protobuf \x01\x02\x03")
    api.etcd.put(keys.node("rack-a-n1"), b"\x08\x96\x01\xff")
    api.etcd.put(keys.job_spec("broken"), b"\x12\x00\xff\xfe")
    api.etcd.put(keys.event(4), b"\xfa\xfb")
    for path in ("/v1/racks", "/v1/nodes", "/v1/gpus", "/v1/jobs", "/v1/events", "/v1/status"):
        assert api.http.get(path).status_code == 200, path
    assert [r["name"] for r in api.http.get("/v1/racks").json()] == list(h.RACKS)
    assert [e["seq"] for e in api.http.get("/v1/events").json()["events"]] == [1, 2, 3]
    assert [j["name"] for j in api.http.get("/v1/jobs").json()] == [h.JOB]
    _error(api.http.get("/v1/jobs/broken"), 404)


def test_unknown_route_and_method(api):
    assert "no such endpoint" in _error(api.http.get("/v1/nothing"), 404)
    _error(api.http.delete("/v1/racks"), 405)
