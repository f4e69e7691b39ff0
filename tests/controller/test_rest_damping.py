"""Flap damping is state the leader and the REST child share: while a recovered GPU is in
its hold-down, GET /v1/gpus shows it held and POST dry-run plans without it, as the
leader's committed plan does; a new leader keeps the hold-down (real controller processes,
their REST children and etcd)."""

from __future__ import annotations

import httpx
from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import (
    ControllerProc,
    PlanWatcher,
    fail_gpu,
    put_job,
    small_cluster,
    wait_leader,
)
from tests.support.wait import wait_until

GPU = ("rack0-n00", 1)


def _plan_gpus(plan: types_pb2.Plan) -> set[tuple[str, int]]:
    return {(g.node, g.index) for r in plan.replicas for st in r.stages for g in st.gpus}


def _gpu(http: httpx.Client) -> dict:
    [view] = [g for g in http.get("/v1/gpus").json() if (g["node"], g["index"]) == GPU]
    return view


def _recovered_seen(http: httpx.Client, written_at: float):
    """The REST child has folded the recovery (its health record is the new one)."""
    view = _gpu(http)
    return view if view["health_updated_at"] >= written_at else None


def test_rest_and_dry_run_agree_with_the_leader_while_a_gpu_is_held(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    env = {"TPFLEX_CONTROLLER__FLAP_HOLD_DOWN_S": "60"}  # outlasts the test on a busy box
    first = ControllerProc(etcd_server.endpoints, "c1", tmp_path, env=env)
    second = None
    try:
        first.wait_http()
        assert GPU in _plan_gpus(watcher.wait_generation(1, timeout=20))
        fail_gpu(etcd, GPU[0], 2, {GPU[1]}, seq=1)
        failed_plan = watcher.wait_generation(2, timeout=20)
        assert GPU not in _plan_gpus(failed_plan)

        fail_gpu(etcd, GPU[0], 2, set(), seq=2)  # healthy again: the leader holds it
        written_at = codec.decode(types_pb2.NodeHealth, etcd.get(keys.health(GPU[0])).value).updated_at
        with httpx.Client(base_url=first.rest_url, timeout=10) as http:
            view = wait_until(lambda: _recovered_seen(http, written_at), 20, "REST folds the recovery")
            assert view["state"] == "failed" and view["held"] is True
            assert view["held_until"] > written_at and "hold-down" in view["hold_reason"]
            held = [(g["node"], g["index"]) for g in http.get("/v1/gpus", params={"state": "failed"}).json()]
            assert held == [GPU]
            dry = http.post("/v1/jobs/job1/dry-run", json={}).json()
            assert dry["current_generation"] == 2
            assert dry["changes"] == []  # the leader's committed plan is what it would plan
            proposed = {(g["node"], g["index"]) for r in dry["plan"]["replicas"]
                        for st in r["stages"] for g in st["gpus"]}
            assert proposed == _plan_gpus(failed_plan)
        assert watcher.latest().generation == 2, "the leader re-planned a held GPU"

        # failover: the hold-down is in etcd, so the next leader keeps the GPU out
        first.kill()
        second = ControllerProc(etcd_server.endpoints, "c2", tmp_path, env=env)
        wait_leader(etcd, other_than="c1", timeout=30)
        second.wait_http()
        # the new leader looks at every job once when elected (reconcile_total counts it)
        wait_until(lambda: second.metric_sum("tpflex_reconcile_total") >= 1, 20, "new leader reconciled")
        assert watcher.latest().generation == 2, "the new leader forgot the hold-down"
        assert etcd.get(keys.gpu_hold(*GPU)) is not None
        with httpx.Client(base_url=second.rest_url, timeout=10) as http:
            view = wait_until(lambda: _recovered_seen(http, written_at), 20, "REST folds the recovery")
            assert view["held"] is True and view["state"] == "failed"
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
        watcher.close()
