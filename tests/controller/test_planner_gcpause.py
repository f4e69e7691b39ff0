"""The planner's entry points pause the cyclic garbage collector (planner/gcpause.py)."""

from __future__ import annotations

import gc

import pytest
from tpflex_controller.planner import plan
from tpflex_controller.planner.incremental import replan
from tpflex_controller.planner.model import PlanningError

from tests.controller.planner_fixtures import failed, make_job, make_racks, state


@pytest.fixture
def collections():
    """Counts the collector's runs while ``counting`` is set."""
    seen = {"n": 0, "on": False}

    def cb(phase, info):
        if phase == "start" and seen["on"]:
            seen["n"] += 1

    gc.callbacks.append(cb)
    yield seen
    gc.callbacks.remove(cb)


def _world():
    racks = make_racks(300, size=8)
    job = make_job(racks, 8)
    return state(racks, gpu_status=failed(*(r.gpus[1] for r in list(racks.values())[::3]))), job


def _count(seen, fn):
    seen["n"], seen["on"] = 0, True
    try:
        return fn()
    finally:
        seen["on"] = False


def test_no_collection_runs_inside_a_plan_and_the_collector_is_on_after(collections):
    cluster, job = _world()
    gc.collect()
    _count(collections, lambda: plan.__wrapped__(cluster, job))
    assert collections["n"] > 0  # the workload allocates enough to trigger collections
    gc.collect()
    whole = _count(collections, lambda: plan(cluster, job))
    assert collections["n"] == 0 and gc.isenabled()
    gc.collect()
    again = _count(collections, lambda: replan(None, cluster, job, None))
    assert collections["n"] == 0 and gc.isenabled()
    assert again.result.same_decision(whole)


def test_the_collector_is_on_after_a_failed_plan_and_stays_off_if_the_caller_paused_it():
    cluster, job = _world()
    bad = state({}, gpu_status={})
    with pytest.raises(PlanningError):
        plan(bad, job)
    assert gc.isenabled()
    gc.disable()
    try:
        plan(cluster, job)
        assert not gc.isenabled()
    finally:
        gc.enable()
