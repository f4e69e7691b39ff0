"""A decision runs with the cyclic collector paused from its re-plan to its commit's end
(reconcile.Reconciler._reconcile_job): no young-generation collection lands between a
failure's re-plan and its transaction (they run after it)."""

from __future__ import annotations

import gc

from tests.controller.controller_harness import controller_on_job, fail_gpu
from tests.support.wait import wait_until


def test_no_collection_runs_inside_a_decision(etcd_server, etcd):
    seen = {"inside": False, "during": 0, "decisions": 0}

    def on_gc(phase, info):
        if phase == "start" and seen["inside"]:
            seen["during"] += 1

    with controller_on_job(etcd_server, etcd, shape=(40, 18, 4)) as (racks, watcher, ctl):
        real = ctl.reconciler._reconcile_job

        def watched(job, d):  # instruments the instance's method: the same loop, same etcd
            seen["inside"] = True
            try:
                return real(job, d)
            finally:
                seen["inside"] = False
                seen["decisions"] += 1

        ctl.reconciler._reconcile_job = watched
        gc.callbacks.append(on_gc)
        thresholds = gc.get_threshold()
        gc.set_threshold(50, 5, 5)  # frequent collections: any unpaused stretch of a decision gets one
        try:
            watcher.wait_generation(1, timeout=30)
            for i, rack in enumerate(racks[:12]):
                fail_gpu(etcd, rack.nodes[0], 4, {i % 4}, seq=1)
                watcher.wait_generation(2 + i, timeout=30)
            assert seen["decisions"] >= 12
            assert seen["during"] == 0, f"{seen['during']} collections inside {seen['decisions']} decisions"
            wait_until(lambda: not seen["inside"], timeout=10, what="the loop to leave its decision")
            assert gc.isenabled()  # process-wide: on again once no decision runs
        finally:
            gc.set_threshold(*thresholds)
            gc.callbacks.remove(on_gc)
