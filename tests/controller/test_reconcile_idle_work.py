"""What the reconcile loop does while idle (Reconciler._idle_work), so that the next
failure's decision does not: build a new plan's cap index (a plan made afresh, by a new
leader or after a restart, is committed without a point look-up of its caps, and the maps
the next re-plans derive from it look GPUs up through that index), and free what the
planner's memos let go of (model.release_evicted)."""

from __future__ import annotations

import weakref

from tpflex_controller.planner import model
from tpflex_controller.planner.caps import MergedCaps

from tests.controller.controller_harness import controller_on_job, fail_gpu
from tests.support.wait import wait_until


def test_a_fresh_plans_cap_index_is_built_before_the_next_failure(etcd_server, etcd):
    def fail_three(racks):  # before the controller starts: three boosted racks
        for i, rack in enumerate(racks[:3]):
            fail_gpu(etcd, rack.nodes[0], 4, {i}, seq=1)

    with controller_on_job(etcd_server, etcd, shape=(6, 4, 4), before_start=fail_three) as (racks, watcher, ctl):
        watcher.wait_generation(1, timeout=30)
        caps = wait_until(lambda: ctl.reconciler._job_plans.get("job1"), timeout=10,
                          what="the job's plan in the loop").result.power_caps
        assert isinstance(caps, MergedCaps) and len(caps.parts) == 3
        wait_until(lambda: caps._root._owner is not None, timeout=10, what="the cap index built while idle")
        assert caps.get((racks[0].nodes[0], 1)) == caps.as_dict()[(racks[0].nodes[0], 1)]


class _Seq(list):
    """A sequence a weak reference can watch (tuples cannot)."""


def test_what_the_moved_memo_lets_go_of_is_freed_only_when_released():
    model.release_evicted()
    old, new = _Seq([1, 2, 3]), _Seq([1, 5, 3])
    gone = weakref.ref(old)
    model.remember_moved(old, new, [1])
    assert model.moved(old, new) == (1,)
    del old, new
    for i in range(3):  # rotates the pair out of the memo (it keeps the last two)
        model.remember_moved(_Seq([i]), _Seq([i + 1]), [0])
    assert gone() is not None  # held until released, not freed on the way
    a, b = _Seq([7, 8]), _Seq([7, 9])
    model.remember_moved(a, b, [0, 1])  # a superset, as remembered
    assert model.release_evicted() >= 4
    assert gone() is None
    assert model.moved(a, b) == (1,)  # after the release: computed afresh, exactly


def test_the_loop_releases_the_memos_when_idle(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd, shape=(4, 2, 4)) as (racks, watcher, _ctl):
        watcher.wait_generation(1, timeout=30)
        for i, rack in enumerate(racks[:3]):
            fail_gpu(etcd, rack.nodes[0], 4, {i}, seq=1)
            watcher.wait_generation(2 + i, timeout=30)
            wait_until(lambda: model._moved_memo is model._NO_MOVED and not model._evicted, timeout=10,
                       what="the memos released after the decision")
