"""The rack inventory over REST against a real etcd and a real uvicorn: PUT / PATCH /
DELETE /v1/racks/{rack} (admin), their checks (4xx with why, nothing written), the job
that uses a rack (409), ?dry_run=true (writes nothing, shows the plan changes), nodes that
no rack lists (/v1/status, tpflex_nodes_unassigned), /v1/inventory/nodes."""

from __future__ import annotations

import pytest
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h
from tests.support.rest import rest_error

NEW = {
    "domain_size": 8, "power_budget_w": 9000.0, "gpu_tdp_w": 1000.0, "gpu_min_w": 200.0,
    "gpu_max_w": 1300.0, "nodes": ["rack-c-n0", "rack-c-n1"], "gpus_per_node": 4,
}
RACK_A = {
    "domain_size": h.T, "power_budget_w": h.T * 1300.0, "gpu_tdp_w": 1000.0, "gpu_min_w": 200.0,
    "gpu_max_w": 1300.0, "nodes": ["rack-a-n0", "rack-a-n1"], "gpus_per_node": h.GPUS_PER_NODE,
}


def _racks_raw(api) -> dict[str, bytes]:
    kvs, _ = api.etcd.get_prefix(keys.RACKS)
    return {kv.key: kv.value for kv in kvs}


def _stored(api, rack: str) -> types_pb2.Rack | None:
    kv = api.etcd.get(keys.rack(rack))
    return codec.decode(types_pb2.Rack, kv.value, kv.key) if kv is not None else None


def _put(api, rack, body, headers=None, **query):
    return api.http.put(f"/v1/racks/{rack}", json=body, params=query,
                        headers=h.admin() if headers is None else headers)


def _patch(api, rack, body, headers=None, **query):
    return api.http.patch(f"/v1/racks/{rack}", json=body, params=query,
                          headers=h.admin() if headers is None else headers)


def _delete(api, rack, headers=None, **query):
    return api.http.delete(f"/v1/racks/{rack}", params=query, headers=h.admin() if headers is None else headers)


# ---- round trip ----


def test_put_creates_then_replaces_patch_merges_delete_removes(api):
    resp = _put(api, "rack-c", {"name": "rack-c", **NEW})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["action"] == "created" and body["dry_run"] is False and body["jobs"] == []
    assert body["record"] == {"name": "rack-c", **NEW}
    assert {c["field"] for c in body["changes"]} == {"name", *NEW}
    stored = _stored(api, "rack-c")
    assert stored == types_pb2.Rack(name="rack-c", **NEW)
    listed = api.http.get("/v1/racks/rack-c").json()
    assert listed["power_budget_w"] == 9000.0 and listed["nodes"] == NEW["nodes"]

    again = _put(api, "rack-c", NEW).json()  # the name may be left out
    assert again["action"] == "unchanged" and again["changes"] == []

    replaced = _put(api, "rack-c", {**NEW, "gpu_tdp_w": 900.0}).json()
    assert replaced["action"] == "changed"
    assert replaced["changes"] == [{"field": "gpu_tdp_w", "before": 1000.0, "after": 900.0}]
    assert _stored(api, "rack-c").gpu_tdp_w == 900.0

    patched = _patch(api, "rack-c", {"power_budget_w": 8000.0, "nodes": ["rack-c-n1", "rack-c-n0"]})
    assert patched.status_code == 200, patched.text
    assert patched.json()["changes"] == [
        {"field": "power_budget_w", "before": 9000.0, "after": 8000.0},
        {"field": "nodes", "before": ["rack-c-n0", "rack-c-n1"], "after": ["rack-c-n1", "rack-c-n0"]},
    ]
    stored = _stored(api, "rack-c")
    assert stored.power_budget_w == 8000.0 and list(stored.nodes) == ["rack-c-n1", "rack-c-n0"]
    assert stored.gpu_tdp_w == 900.0 and stored.domain_size == 8  # the rest as stored

    gone = _delete(api, "rack-c")
    assert gone.status_code == 200 and gone.json()["action"] == "deleted" and gone.json()["record"] is None
    assert api.etcd.get(keys.rack("rack-c")) is None
    assert api.http.get("/v1/racks/rack-c").status_code == 404
    assert "not found" in rest_error(_delete(api, "rack-c"), 404)["message"]


def test_patch_of_an_absent_rack_is_404_and_writes_nothing(api):
    before = _racks_raw(api)
    assert "PUT creates" in rest_error(_patch(api, "rack-z", {"power_budget_w": 5000.0}), 404)["message"]
    assert _racks_raw(api) == before


def test_a_job_s_rack_change_is_reported_with_the_job(api):
    body = _patch(api, "rack-a", {"power_budget_w": 9000.0}).json()
    assert body["action"] == "changed" and [j["job"] for j in body["jobs"]] == [h.JOB]
    assert body["jobs"][0]["replans"] is True
    assert _stored(api, "rack-a").power_budget_w == 9000.0


# ---- checks: 4xx with why, nothing written ----

BAD_PUTS = [
    ({**RACK_A, "domain_size": 0}, 422, "domain_size"),
    ({**RACK_A, "domain_size": 6}, 422, "is not its 2 node(s) x gpus_per_node 4 = 8 GPUs"),
    ({**RACK_A, "gpus_per_node": 0}, 422, "gpus_per_node"),
    ({**RACK_A, "gpus_per_node": 3}, 422, "gpus_per_node 3 = 6 GPUs"),
    ({**RACK_A, "power_budget_w": 0}, 422, "power_budget_w"),
    ({**RACK_A, "power_budget_w": -5.0}, 422, "power_budget_w"),
    ({**RACK_A, "power_budget_w": 1000.0}, 422, "below domain_size 8 x gpu_min_w 200 W = 1600 W"),
    ({**RACK_A, "gpu_min_w": 1100.0}, 422, "gpu_min_w <= gpu_tdp_w <= gpu_max_w"),
    ({**RACK_A, "gpu_max_w": 900.0}, 422, "gpu_min_w <= gpu_tdp_w <= gpu_max_w"),
    ({**RACK_A, "nodes": ["rack-a-n0", "rack-a-n0"]}, 422, "node rack-a-n0 is listed twice"),
    ({**RACK_A, "nodes": ["rack-a-n0", "bad/name"]}, 422, "nodes"),
    ({**RACK_A, "nodes": ["rack-a-n0", "-lead"]}, 422, "node name must be"),
    ({**RACK_A, "nodes": []}, 422, "nodes"),
    ({**RACK_A, "name": "rack-b"}, 422, "is not the path's rack 'rack-a'"),
    ({**RACK_A, "colour": "red"}, 422, "colour"),
    ({**RACK_A, "gpu_tdp_w": "1000"}, 422, "gpu_tdp_w"),
    ({k: v for k, v in RACK_A.items() if k != "power_budget_w"}, 422, "power_budget_w"),
    # valid alone, but the job on rack-a needs 8 GPUs (base_tp 8): a conflict
    ({**RACK_A, "domain_size": 4, "nodes": ["rack-a-n0"]}, 409, f"job {h.JOB} uses it"),
]


@pytest.mark.parametrize("body,status,why", BAD_PUTS, ids=[str(i) for i in range(len(BAD_PUTS))])
def test_bad_put_is_4xx_with_why_and_writes_nothing(api, body, status, why):
    before = _racks_raw(api)
    assert why in str(rest_error(_put(api, "rack-a", body), status))
    assert why in str(rest_error(_put(api, "rack-a", body, dry_run="true"), status))
    assert _racks_raw(api) == before


BAD_PATCHES = [
    ({"gpu_min_w": 1100.0}, 422, "gpu_min_w <= gpu_tdp_w <= gpu_max_w"),
    ({"power_budget_w": 1500.0}, 422, "below domain_size"),
    ({"domain_size": 12}, 422, "= 8 GPUs"),
    ({"nodes": ["rack-a-n0", "rack-a-n0"]}, 422, "listed twice"),
    ({"name": "other"}, 422, "is not the path's rack"),
    ({}, 422, "nothing to change"),
    ({"power_budget_w": None}, 422, "nothing to change"),
    ({"budget": 5}, 422, "budget"),
    ({"nodes": ["rack-a-n0"], "domain_size": 4}, 409, f"job {h.JOB} uses it"),
]


@pytest.mark.parametrize("body,status,why", BAD_PATCHES, ids=[str(i) for i in range(len(BAD_PATCHES))])
def test_bad_patch_is_4xx_with_why_and_writes_nothing(api, body, status, why):
    before = _racks_raw(api)
    assert why in str(rest_error(_patch(api, "rack-a", body), status))
    assert _racks_raw(api) == before


def test_bad_path_name_is_422(api):
    before = _racks_raw(api)
    rest_error(_put(api, "bad name", RACK_A), 422)
    rest_error(_put(api, "a" * 64, {**RACK_A, "nodes": ["n0", "n1"]}), 422)
    assert _racks_raw(api) == before


def test_delete_of_a_rack_a_job_uses_is_409(api):
    before = _racks_raw(api)
    msg = rest_error(_delete(api, "rack-a"), 409)["message"]
    assert "rack-a" in msg and h.JOB in msg
    rest_error(_delete(api, "rack-a", dry_run="true"), 409)
    assert _racks_raw(api) == before
    # a spare rack counts as used too
    _put(api, "rack-c", NEW)
    job = api.store.job(h.JOB)
    job.spare_racks.append("rack-c")
    api.store.put_job(job)
    assert "rack-c" in rest_error(_delete(api, "rack-c"), 409)["message"]
    assert _stored(api, "rack-c") is not None


# ---- auth ----


@pytest.mark.parametrize("headers,status", [({}, 401), ({"Authorization": "Bearer nope"}, 401),
                                            (h.reader(), 403)])
def test_writes_need_an_admin_token(api, headers, status):
    before = _racks_raw(api)
    rest_error(_put(api, "rack-c", NEW, headers=headers), status)
    rest_error(_put(api, "rack-a", {**RACK_A, "power_budget_w": 9000.0}, headers=headers, dry_run="true"), status)
    rest_error(_patch(api, "rack-a", {"power_budget_w": 9000.0}, headers=headers), status)
    rest_error(_delete(api, "rack-b", headers=headers), status)
    assert _racks_raw(api) == before


# ---- dry run ----


def test_dry_run_writes_nothing_and_shows_the_plan_changes(api):
    # a failed GPU in rack-a: its replica runs at TP 7, boosted within the rack's budget
    h.put_health(api.store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")})
    before = _racks_raw(api)
    revision = api.etcd.get(keys.rack("rack-a")).mod_revision
    resp = _put(api, "rack-a", {**RACK_A, "power_budget_w": 7000.0}, dry_run="true")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["dry_run"] is True and body["action"] == "changed"
    assert body["changes"] == [{"field": "power_budget_w", "before": h.T * 1300.0, "after": 7000.0}]
    [impact] = body["jobs"]
    assert impact["job"] == h.JOB and impact["changes"], impact
    caps = [c for c in impact["changes"] if c["kind"] == "power_cap"]
    assert caps and all(c["gpu"]["node"].startswith("rack-a-") for c in caps)
    assert all(c["after"] is None or c["after"] < c["before"] for c in caps if c["before"] is not None)
    assert _racks_raw(api) == before
    assert api.etcd.get(keys.rack("rack-a")).mod_revision == revision

    same = _put(api, "rack-a", {**RACK_A, "power_budget_w": h.T * 1300.0 + 1}, dry_run="true").json()
    assert same["jobs"][0]["changes"] == [] and "same" in same["jobs"][0]["note"]

    created = _put(api, "rack-c", NEW, dry_run="true").json()
    assert created["action"] == "created" and created["dry_run"] is True
    assert api.etcd.get(keys.rack("rack-c")) is None

    _put(api, "rack-c", NEW)
    deleted = _delete(api, "rack-c", dry_run="true").json()
    assert deleted["action"] == "deleted" and deleted["dry_run"] is True
    assert _stored(api, "rack-c") is not None

    patched = _patch(api, "rack-a", {"power_budget_w": 7000.0}, dry_run="true").json()
    assert patched["dry_run"] is True and patched["jobs"][0]["changes"]
    assert _stored(api, "rack-a").power_budget_w == h.T * 1300.0


# ---- nodes no rack lists ----


def _metric(api, name: str) -> float | None:
    for line in api.http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_unassigned_nodes_in_status_and_metrics(api):
    assert api.http.get("/v1/status").json()["unassigned_nodes"] == []
    assert _metric(api, "tpflex_nodes_unassigned") == 0.0
    h.register(api.store, "rack0", "stray-n0")  # its rack has no record
    h.register(api.store, "rack-b", "rack-b-n9")  # its rack's record does not list it
    status = api.http.get("/v1/status").json()
    assert status["unassigned_nodes"] == [
        {"node": "rack-b-n9", "rack": "rack-b", "reason": "rack record 'rack-b' does not list node 'rack-b-n9'"},
        {"node": "stray-n0", "rack": "rack0", "reason": "no rack record 'rack0'"},
    ]
    assert _metric(api, "tpflex_nodes_unassigned") == 2.0
    rack0 = {**NEW, "domain_size": 4, "power_budget_w": 4000.0, "nodes": ["stray-n0"]}
    assert _put(api, "rack0", rack0).status_code == 200
    status = api.http.get("/v1/status").json()
    assert [n["node"] for n in status["unassigned_nodes"]] == ["rack-b-n9"]
    assert _metric(api, "tpflex_nodes_unassigned") == 1.0


def test_node_inventory_lists_registrations_with_limits(api):
    h.register(api.store, "rack0", "stray-n0")
    nodes = api.http.get("/v1/inventory/nodes").json()
    by_name = {n["name"]: n for n in nodes}
    assert sorted(by_name) == sorted([*(h.node_name(r, i) for r in h.RACKS for i in range(2)), "stray-n0"])
    stray = by_name["stray-n0"]
    assert stray["rack"] == "rack0" and stray["assigned"] is False
    assert by_name["rack-a-n0"]["assigned"] is True
    assert [g["index"] for g in stray["gpus"]] == list(range(h.GPUS_PER_NODE))
    g = stray["gpus"][0]
    assert (g["min_limit_w"], g["default_limit_w"], g["max_limit_w"]) == (200.0, 1000.0, 1300.0)
