"""REST API operations against a real etcd and a real uvicorn: drain / undrain,
reconfigure, dry-run (commits nothing), auth, and impossible requests (422 with why)."""

from __future__ import annotations

import threading

import pytest
from tpflex_controller.store import RequiredKeyGone
from tpflex_proto import keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.controller import api_harness as h
from tests.support.rest import rest_error

DRAIN = "/v1/nodes/rack-a-n1/gpus/2/drain"
UNDRAIN = "/v1/nodes/rack-a-n1/gpus/2/undrain"
RECONF = f"/v1/jobs/{h.JOB}/reconfigure"
DRY = f"/v1/jobs/{h.JOB}/dry-run"

MUTATIONS = [
    (DRAIN, {"reason": "test"}),
    (UNDRAIN, None),
    (RECONF, {"pins": [{"replica": 0, "tp_degree": 6}]}),
]


def _error(resp, status: int) -> str:
    return rest_error(resp, status)["message"]


def _post(api, path, body=None, headers=None):
    return api.http.post(path, json=body, headers=h.admin() if headers is None else headers)


# ---- drain / undrain ----


def test_drain_writes_override_and_undrain_removes_it(api):
    resp = _post(api, DRAIN, {"reason": "flaky NVLink"})
    assert resp.status_code == 202 and resp.json()["changed"] is True
    override = api.store.gpu_overrides()[("rack-a-n1", 2)]
    assert override.drained and override.reason == "flaky NVLink" and override.at == h.NOW
    gpu = api.http.get("/v1/nodes/rack-a-n1/gpus/2").json()
    assert gpu["state"] == "drained" and gpu["drain_reason"] == "flaky NVLink"
    assert _post(api, DRAIN, {"reason": "again"}).json()["changed"] is False
    resp = _post(api, UNDRAIN)
    assert resp.status_code == 202 and resp.json() == {
        "node": "rack-a-n1", "index": 2, "drained": False, "changed": True, "reason": ""}
    assert api.etcd.get(keys.gpu_override("rack-a-n1", 2)) is None
    assert api.http.get("/v1/nodes/rack-a-n1/gpus/2").json()["state"] == "healthy"
    assert _post(api, UNDRAIN).json()["changed"] is False


def test_undrain_keeps_an_operator_power_pin(api):
    pin = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node="rack-a-n1", index=2), drained=True,
                                reason="x", power_cap_w=900.0)
    api.store.put_gpu_override(pin)
    _post(api, UNDRAIN)
    kept = api.store.gpu_overrides()[("rack-a-n1", 2)]
    assert not kept.drained and kept.power_cap_w == 900.0


def test_drain_of_a_gpu_that_does_not_exist_is_422(api):
    msg = _error(_post(api, "/v1/nodes/rack-a-n1/gpus/7/drain", {"reason": "x"}), 422)
    assert "rack-a-n1:7 does not exist" in msg and "0..3" in msg
    msg = _error(_post(api, "/v1/nodes/ghost/gpus/0/drain", {"reason": "x"}), 422)
    assert "no node 'ghost'" in msg
    _error(_post(api, "/v1/nodes/ghost/gpus/0/undrain"), 422)
    assert api.store.gpu_overrides() == {}


def test_malformed_drain_bodies_are_422(api):
    assert "reason" in _error(_post(api, DRAIN, {}), 422)
    _error(_post(api, DRAIN, {"reason": ""}), 422)
    _error(_post(api, DRAIN, {"reason": "x", "extra": 1}), 422)
    bad_json = api.http.post(DRAIN, content=b"{not json", headers={**h.admin(), "Content-Type": "application/json"})
    _error(bad_json, 422)
    _error(_post(api, "/v1/nodes/rack-a-n1/gpus/-1/drain", {"reason": "x"}), 422)
    assert api.store.gpu_overrides() == {}


@pytest.mark.parametrize("path,body", MUTATIONS)
def test_mutations_need_an_admin_token(api, path, body):
    assert "missing bearer token" in _error(_post(api, path, body, headers={}), 401)
    wrong = {"Authorization": "Bearer not-a-token"}
    assert "unknown bearer token" in _error(_post(api, path, body, headers=wrong), 401)
    assert "read-only" in _error(_post(api, path, body, headers=h.reader()), 403)
    assert api.store.gpu_overrides() == {} and api.store.job_override(h.JOB) is None


# ---- reconfigure ----


def test_reconfigure_pins_merge_and_policy_switch(api):
    resp = _post(api, RECONF, {"pins": [{"replica": 1, "tp_degree": 6}], "reason": "test"})
    assert resp.status_code == 202
    stored = api.store.job_override(h.JOB)
    assert [(p.replica, p.tp_degree) for p in stored.pins] == [(1, 6)] and stored.reason == "test"
    _post(api, RECONF, {"pins": [{"replica": 0, "tp_degree": 4}], "policy": "ntp"})
    stored = api.store.job_override(h.JOB)
    assert [(p.replica, p.tp_degree) for p in stored.pins] == [(0, 4), (1, 6)] and stored.policy == "ntp"
    job = api.http.get(f"/v1/jobs/{h.JOB}").json()
    assert job["effective_policy"] == "ntp" and job["override"]["pins"][0] == {"replica": 0, "tp_degree": 4}
    cleared = _post(api, RECONF, {"clear": True})
    assert cleared.status_code == 202 and cleared.json()["override"] is None
    assert api.store.job_override(h.JOB) is None


@pytest.mark.parametrize("pins,why", [
    ([{"replica": 0, "tp_degree": 0}], "at least 1"),
    ([{"replica": 0, "tp_degree": 9}], "above the job's base TP degree 8"),
    ([{"replica": 0, "tp_degree": 3}], "below the job's min_tp 4"),
    ([{"replica": 2, "tp_degree": 6}], "replica 2 does not exist"),
    ([{"replica": 0, "tp_degree": 6}, {"replica": 0, "tp_degree": 5}], "more than once"),
])
def test_impossible_pins_are_422(api, pins, why):
    assert why in _error(_post(api, RECONF, {"pins": pins}), 422)
    assert api.store.job_override(h.JOB) is None


def test_pin_above_usable_gpus_or_unit_count_is_422(api):
    h.put_health(api.store, "rack-b-n0", {0: (types_pb2.GPU_FAILED, "xid 79"), 1: (types_pb2.GPU_FAILED, "xid 48")})
    msg = _error(_post(api, RECONF, {"pins": [{"replica": 1, "tp_degree": 7}]}), 422)
    assert "above its 6 usable GPUs" in msg and "rack-b" in msg
    assert _post(api, RECONF, {"pins": [{"replica": 1, "tp_degree": 6}]}).status_code == 202
    api.store.put_job(h.job_spec("small", units={"heads": 32, "kv_groups": 6}))
    msg = _error(_post(api, "/v1/jobs/small/reconfigure", {"pins": [{"replica": 0, "tp_degree": 7}]}), 422)
    assert "no units" in msg and "'kv_groups' has only 6" in msg


def test_reconfigure_bad_requests(api):
    assert "ntp-pw" in _error(_post(api, RECONF, {"policy": "fastest"}), 422)
    assert "nothing to do" in _error(_post(api, RECONF, {}), 422)
    assert "not found" in _error(_post(api, "/v1/jobs/nope/reconfigure", {"policy": "ntp"}), 404)
    _error(_post(api, RECONF, {"pins": [{"replica": 0}]}), 422)
    _error(_post(api, RECONF, {"pins": "all"}), 422)
    _error(_post(api, RECONF, {"pins": [{"replica": True, "tp_degree": 6}]}), 422)
    _error(_post(api, RECONF, {"pins": [{"replica": 0, "tp_degree": 6.0}]}), 422)
    assert api.store.job_override(h.JOB) is None


def test_an_override_is_written_only_while_the_job_exists(api):
    """A reconfigure checks that the job exists, then writes its override; a delete of
    the job in between removed the spec (and no override yet), and the override written
    after it outlived the job: 404 to both a clear and a delete, and a job registered again
    under the name was planned at the stale pin. The write now requires the spec."""
    store = api.store
    with pytest.raises(RequiredKeyGone):
        store.update(keys.job_override("gone"), types_pb2.JobOverride,
                     lambda old: types_pb2.JobOverride(job="gone", policy="ntp"), requires=keys.job_spec("gone"))
    assert api.etcd.get(keys.job_override("gone")) is None
    orphans = 0
    for _ in range(20):  # the race, for real: a reconfigure and a delete at once
        store.put_job(h.job_spec())
        answers: dict[str, int] = {}
        start = threading.Barrier(2)

        def call(name, method, path, body=None, start=start, answers=answers):
            start.wait()
            answers[name] = api.http.request(method, path, json=body, headers=h.admin()).status_code

        threads = [threading.Thread(target=call, args=("reconf", "POST", RECONF, {"pins": [{"replica": 0, "tp_degree": 6}]})),
                   threading.Thread(target=call, args=("delete", "DELETE", f"/v1/jobs/{h.JOB}"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert answers["delete"] == 202 and answers["reconf"] in (202, 404), answers
        orphans += api.etcd.get(keys.job_override(h.JOB)) is not None
    assert orphans == 0, f"{orphans} of 20 races left an override without its job"


# ---- dry-run ----


def test_dry_run_plans_hypothetical_failures_and_commits_nothing(api):
    before_plan = api.etcd.get(keys.job_plan(h.JOB))
    _, rev_before = api.etcd.get_prefix(keys.PREFIX)
    body = {"fail": [{"node": "rack-a-n0", "index": 1}]}
    resp = api.http.post(DRY, json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["committed"] is False and out["current_generation"] == 1
    assert out["failed_gpus"] == [{"node": "rack-a-n0", "index": 1}]
    plan = out["plan"]
    assert [r["tp_degree"] for r in plan["replicas"]] == [7, 8]
    used = [(g["node"], g["index"]) for g in plan["replicas"][0]["stages"][0]["gpus"]]
    assert ("rack-a-n0", 1) not in used and len(used) == 7
    assert plan["reasons"] and plan["replicas"][0]["reason"]
    assert 0 < plan["expected_throughput_ratio"] <= 1
    assert out["current_expected_throughput_ratio"] == pytest.approx(api.plan.expected_throughput_ratio)
    after_plan = api.etcd.get(keys.job_plan(h.JOB))
    _, rev_after = api.etcd.get_prefix(keys.PREFIX)
    assert after_plan.mod_revision == before_plan.mod_revision and rev_after == rev_before


def test_dry_run_policy_and_overrides(api):
    body = {"fail": [{"node": "rack-b-n1", "index": 3}], "policy": "dp-drop"}
    plan = api.http.post(DRY, json=body).json()["plan"]
    assert plan["policy"] == "dp-drop" and [r["state"] for r in plan["replicas"]] == ["healthy", "dropped"]
    _post(api, RECONF, {"pins": [{"replica": 0, "tp_degree": 5}]})
    pinned = api.http.post(DRY).json()["plan"]  # no body: the current state as is
    assert [r["tp_degree"] for r in pinned["replicas"]] == [5, 8]
    free = api.http.post(DRY, json={"ignore_overrides": True}).json()["plan"]
    assert [r["tp_degree"] for r in free["replicas"]] == [8, 8]
    # the pin cannot hold if rack-a loses four GPUs: it is suspended (with the planner's
    # reason) and the failed GPUs leave the plan all the same
    fail4 = [{"node": "rack-a-n0", "index": i} for i in range(4)]
    out = api.http.post(DRY, json={"fail": fail4}).json()["plan"]
    assert [(p["replica"], p["tp_degree"]) for p in out["suspended_pins"]] == [(0, 5)]
    assert "usable GPUs" in out["suspended_pins"][0]["reason"]
    used = {(g["node"], g["index"]) for r in out["replicas"] for st in r["stages"] for g in st["gpus"]}
    assert not used & {("rack-a-n0", i) for i in range(4)} and out["replicas"][0]["tp_degree"] == 4


def test_dry_run_bad_requests(api):
    assert "does not exist" in _error(api.http.post(DRY, json={"fail": [{"node": "rack-a-n0", "index": 9}]}), 422)
    _error(api.http.post(DRY, json={"policy": "yolo"}), 422)
    _error(api.http.post(DRY, json={"fail": [{"node": "", "index": 0}]}), 422)
    assert "not found" in _error(api.http.post("/v1/jobs/nope/dry-run", json={}), 404)


# ---- etcd outage ----


def test_etcd_outage_gives_503_and_recovers(etcd_server, tmp_path):
    etcd = Etcd(etcd_server.endpoints, timeout=1.0)
    served = h.serve(etcd, h.write_token_file(tmp_path))
    try:
        h.seed(served.store)
        assert served.http.get("/readyz").status_code == 200
        etcd_server.members[0].stop()
        assert "etcd unreachable" in _error(served.http.get("/readyz"), 503)
        assert "etcd" in _error(_post(served, DRAIN, {"reason": "x"}), 503)
        _error(_post(served, RECONF, {"policy": "ntp"}), 503)
        _error(served.http.get("/v1/racks"), 503)
        assert served.http.get("/healthz").status_code == 200
        etcd_server.restart_member(0)
        _wait_ready(served)
        assert _post(served, DRAIN, {"reason": "back"}).status_code == 202
        assert served.store.gpu_overrides()[("rack-a-n1", 2)].reason == "back"
    finally:
        served.http.close()
        served.app_server.stop()
        etcd.close()


def _wait_ready(served, timeout: float = 15.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if served.http.get("/readyz").status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError("/readyz did not return to 200 after etcd came back")
