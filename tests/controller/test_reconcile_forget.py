"""A deleted job's state leaves the reconcile loop with its plan: nothing of its last
plan stays alive in the controller (a cluster that creates and deletes jobs for weeks
would otherwise keep every one)."""

from __future__ import annotations

import gc

from tpflex_controller.planner.model import PlanResult
from tpflex_proto import keys

from tests.controller.controller_harness import controller_on_job, fail_gpu
from tests.support.wait import wait_until


def _results_of(job: str) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is PlanResult and o.job == job)


def test_a_deleted_jobs_plans_do_not_stay_alive(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (_racks, watcher, ctl):
        watcher.wait_generation(1)
        fail_gpu(etcd, "rack1-n00", 2, {1})
        watcher.wait_generation(2)
        gc.collect()
        assert _results_of("job1") >= 1  # the loop holds the job's last plan while it lives
        etcd.delete(keys.job_spec("job1"))
        wait_until(lambda: etcd.get(keys.job_plan("job1")) is None, 20, "deleted job's plan retired")
        ctl.stop()  # joins the loop: what it holds now is what it keeps
        gc.collect()
        assert _results_of("job1") == 0
        assert not ctl.reconciler._encoder._last and not ctl.reconciler._encoder._layout
