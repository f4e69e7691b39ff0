"""A deleted job's state leaves the reconcile loop with its plan: nothing of its last
plan stays alive in the controller (a cluster that creates and deletes jobs for weeks
would otherwise keep every one)."""

from __future__ import annotations

import gc
import types
import weakref

from tpflex_controller.planner.model import PlanResult
from tpflex_proto import keys

from tests.controller.controller_harness import controller_on_job, fail_gpu
from tests.support.wait import wait_until


def _results_of(job: str, before: set[int]) -> list[PlanResult]:
    """The job's plans the collector tracks (the permanent generation, where the loop's
    ``gc.freeze`` puts its state, is not among them), but those in ``before``."""
    return [o for o in gc.get_objects() if type(o) is PlanResult and o.job == job and id(o) not in before]


def _holders(results: list[PlanResult]) -> str:
    """What keeps each plan alive, a few referrers up, for a failing assertion to name."""
    lines = []
    for o in results:
        cur, seen = o, {id(o), id(results)}
        for depth in range(5):
            refs = [r for r in gc.get_referrers(cur) if id(r) not in seen]
            seen.add(id(refs))
            lines.append("  " * depth + (", ".join(_name(r) for r in refs[:4]) or "(no tracked referrer)"))
            if not refs:
                break
            cur = refs[0]
            seen.add(id(cur))
    return "\n".join(lines)


def _name(o: object) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} {o.f_code.co_filename}:{o.f_lineno}"
    if isinstance(o, dict):
        return f"dict(keys={list(o)[:4]})"
    if isinstance(o, (list, tuple, set)):
        return f"{type(o).__name__}(len={len(o)})"
    return type(o).__qualname__


def _plans_now() -> set[int]:
    """The plans alive before a test's controller starts: an earlier test's controller
    may have left plans of its job1 in the permanent generation, or alive in it; they
    are not this controller's."""
    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is PlanResult}


def _fail_one_and_settle(etcd, watcher, loop: weakref.ref) -> None:
    """job1's first plan, one GPU failure and its plan, and the loop's heap frozen."""
    watcher.wait_generation(1)
    fail_gpu(etcd, "rack1-n00", 2, {1})
    watcher.wait_generation(2)
    wait_until(lambda: loop()._froze, 10, "the loop froze its state after its first pass")


def test_a_deleted_jobs_plans_do_not_stay_alive(etcd_server, etcd):
    before = _plans_now()
    with controller_on_job(etcd_server, etcd) as (_racks, watcher, ctl):
        _fail_one_and_settle(etcd, watcher, weakref.ref(ctl.reconciler))
        gc.unfreeze()  # see the loop's state (its plans may have been frozen with it)
        gc.collect()
        assert _results_of("job1", before)  # the loop holds the job's last plan while it lives
        etcd.delete(keys.job_spec("job1"))
        wait_until(lambda: etcd.get(keys.job_plan("job1")) is None, 20, "deleted job's plan retired")
        ctl.stop()  # joins the loop: what it holds now is what it keeps
        assert gc.get_freeze_count() == 0  # the stopped loop gave its frozen state back
        gc.collect()
        left = _results_of("job1", before)
        assert not left, _holders(left)
        assert not ctl.reconciler._encoder._last and not ctl.reconciler._encoder._layout


def test_a_stopped_controller_is_collected(etcd_server, etcd):
    """The loop freezes the heap after its first pass (the long-lived view leaves the
    collector's scans); once stopped, it and its plans are garbage the collector frees:
    a process that stops a controller and goes on does not keep it."""
    before = _plans_now()
    with controller_on_job(etcd_server, etcd) as (_racks, watcher, ctl):
        loop = weakref.ref(ctl.reconciler)
        _fail_one_and_settle(etcd, watcher, loop)
    del ctl, watcher
    gc.collect()
    assert loop() is None, _holders([loop()])
    left = _results_of("job1", before)
    assert not left, _holders(left)
