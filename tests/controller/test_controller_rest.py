"""Component test: the real tpflex-controller process, driven through its REST API with
httpx: drain/undrain a GPU changes and restores the plan; bad calls change nothing."""

from __future__ import annotations

import httpx

from tests.controller.controller_harness import ControllerProc, PlanWatcher, put_job, small_cluster
from tests.support.wait import wait_until

TOKEN = "s3cret-admin-token"


def test_drain_and_undrain_through_rest_change_and_restore_the_plan(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    tokens = tmp_path / "admin.tokens"
    tokens.write_text(f"# admin tokens\n{TOKEN}\n")
    watcher = PlanWatcher(etcd, "job1")
    proc = ControllerProc(etcd_server.endpoints, "rest1", tmp_path, extra=["--admin-tokens-file", str(tokens)])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        proc.wait_http()
        watcher.wait_generation(1, timeout=20)
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            ready = wait_until(  # 503 until the API's etcd cache has folded the leader key
                lambda: (r := http.get("/readyz")).status_code == 200 and r.json(), 10, "readyz 200")
            assert ready["leader"] == "rest1"
            drain = "/v1/nodes/rack1-n00/gpus/1/drain"
            assert http.post(drain, json={"reason": "flaky NVLink"}).status_code == 401
            assert http.post(drain, json={"reason": "x"}, headers={"Authorization": "Bearer nope"}).status_code == 401
            r = http.post("/v1/nodes/rack1-n00/gpus/9/drain", json={"reason": "x"}, headers=auth)
            assert r.status_code == 422 and r.json()  # a GPU that does not exist
            assert watcher.latest().generation == 1  # rejected calls changed nothing

            r = http.post(drain, json={"reason": "flaky NVLink"}, headers=auth)
            assert r.status_code == 202, r.text
            drained = watcher.wait_generation(2)
            assert drained.cause == "drain"
            assert [rp.tp_degree for rp in drained.replicas] == [4, 3]
            assert ("rack1-n00", 1) not in {(g.node, g.index) for s in drained.replicas[1].stages for g in s.gpus}
            # the leader wrote it, not this request: the REST child's view follows its watch
            view = wait_until(lambda: (v := http.get("/v1/jobs/job1/plan").json())["generation"] == 2 and v,
                              10, "the REST view of generation 2")
            assert view["generation"] == 2

            r = http.post("/v1/nodes/rack1-n00/gpus/1/undrain", headers=auth)
            assert r.status_code == 202, r.text
            restored = watcher.wait_generation(3)
            assert restored.cause == "undrain"
            assert [rp.tp_degree for rp in restored.replicas] == [4, 4] and not restored.power_caps
            assert proc.metric("tpflex_plan_generation") == 3.0
        assert proc.terminate() == 0
    finally:
        watcher.close()
        proc.kill()
