"""The reconcile loop builds a new plan's cap index while idle (Reconciler._warm_caps), not
in the next failure's decision: a plan made afresh (a new leader, a restart) is committed
without a point look-up of its caps, and the maps the next re-plans derive from it look
GPUs up through that index."""

from __future__ import annotations

from tpflex_controller.planner.caps import MergedCaps

from tests.controller.controller_harness import (
    PlanWatcher,
    fail_gpu,
    put_job,
    small_cluster,
    start_controller,
)
from tests.support.wait import wait_until


def test_a_fresh_plans_cap_index_is_built_before_the_next_failure(etcd_server, etcd):
    racks = small_cluster(etcd, racks=6, nodes_per_rack=4, gpus_per_node=4)
    for i, rack in enumerate(racks[:3]):  # failed before the controller starts: boosted racks
        fail_gpu(etcd, rack.nodes[0], 4, {i}, seq=1)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    ctl = start_controller(etcd_server.endpoints)
    try:
        watcher.wait_generation(1, timeout=30)
        caps = wait_until(lambda: ctl.reconciler._job_plans.get("job1"), timeout=10,
                          what="the job's plan in the loop").result.power_caps
        assert isinstance(caps, MergedCaps) and len(caps.parts) == 3
        wait_until(lambda: caps._root._owner is not None, timeout=10, what="the cap index built while idle")
        assert caps.get((racks[0].nodes[0], 1)) == caps.as_dict()[(racks[0].nodes[0], 1)]
    finally:
        ctl.stop()
        watcher.close()
