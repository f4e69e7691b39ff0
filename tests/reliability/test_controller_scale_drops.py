"""bench/controller_scale.py times a failure up to the first generation whose plan drops
the failed GPU (issue 35): a generation committed for another reason, which keeps it, is
not its commit. Against a real etcd and a real in-process controller (the bench's
Reconciler and Elector), its plans stored in parts as the controller writes them."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.controller.controller_harness import controller_on_job, fail_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # as the bench runs

from tpflex_proto import keys, planstore  # noqa: E402

from bench.controller_scale import _plan_uses, _PlanArrivals  # noqa: E402


def test_only_a_generation_that_drops_the_failed_gpu_counts(etcd_server, etcd):
    arrivals: list[_PlanArrivals] = []
    with controller_on_job(etcd_server, etcd, shape=(2, 2, 4),
                           before_start=lambda racks: arrivals.append(_PlanArrivals(etcd, "job1"))):
        [seen] = arrivals
        try:
            seen.wait(1, timeout=20)
            header = planstore.decode_plan(etcd.get(keys.job_plan("job1")).value, "header")
            assert header.split and not header.replicas, "the controller stores its plans in parts"
            first = planstore.read_plan(etcd, "job1")
            assert _plan_uses(first, "rack0-n00", 1) and _plan_uses(first, "rack1-n01", 2)

            # the failed GPU dropped: its generation counts
            seen.expect_drop("rack0", "rack0-n00", 1)
            fail_gpu(etcd, "rack0-n00", 4, {1})
            gen, at = seen.wait_drop(20)
            assert gen == 2 and at == seen.arrived[2] and seen.kept == 0
            assert not _plan_uses(planstore.read_plan(etcd, "job1"), "rack0-n00", 1)

            # a generation for another GPU's failure keeps the one asked about: not its commit
            seen.expect_drop("rack1", "rack1-n01", 2)
            fail_gpu(etcd, "rack1-n01", 4, {3})
            seen.wait(3, timeout=20)
            third = planstore.read_plan(etcd, "job1")
            assert third.generation == 3 and _plan_uses(third, "rack1-n01", 2)
            assert not _plan_uses(third, "rack1-n01", 3)
            assert seen.wait_drop(0.0) is None and seen.kept == 1

            # then its own failure: the generation dropping it counts, after one that kept it
            seen.expect_drop("rack1", "rack1-n01", 2)
            fail_gpu(etcd, "rack1-n01", 4, {2, 3}, seq=2)
            gen, _ = seen.wait_drop(20)
            assert gen == 4 and seen.kept == 0
        finally:
            seen.close()
