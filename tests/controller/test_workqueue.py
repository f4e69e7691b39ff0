"""The reconcile work queue: its outcome table (pure), and a lost compare-and-swap that
re-reads only the job it is about (a real etcd and an in-process controller)."""

from __future__ import annotations

import logging
import random
import time

from tpflex_controller.workqueue import OUTCOMES, Action, Result, WorkQueue
from tpflex_proto import keys
from tpflex_proto.informer import Batch, Op, decode_change

from tests.controller.controller_harness import controller_on_job, eventually, fail_gpu


def test_outcome_table_covers_every_result():
    assert set(OUTCOMES) == set(Result)
    assert OUTCOMES[Result.OK] is Action.FORGET and OUTCOMES[Result.UNPLANNABLE] is Action.FORGET
    assert OUTCOMES[Result.CONFLICT] is Action.REREAD
    assert OUTCOMES[Result.ETCD_ERROR] is Action.RETRY and OUTCOMES[Result.ERROR] is Action.RETRY_SLOW


def test_settle_applies_the_table():
    q = WorkQueue(rng=random.Random(1))
    for job in ("a", "b", "c", "d"):
        q.mark(job, "gpu_failed", at=1.0, now=10.0)
    assert [j for j, _ in q.due(10.0)] == ["a", "b", "c", "d"]
    assert q.settle("a", Result.OK, 10.0) is Action.FORGET and "a" not in q
    assert q.settle("b", Result.CONFLICT, 10.0) is Action.REREAD
    assert q.get("b").not_before == 0.0  # re-read, then planned again at once
    assert q.settle("b", Result.CONFLICT, 10.0) is Action.REREAD
    assert 10.05 <= q.get("b").not_before <= 10.1  # a second conflict in a row backs off
    q.settle("c", Result.ETCD_ERROR, 10.0)
    assert 10.025 <= q.get("c").not_before <= 10.05  # jittered: [half, all] of 0.05 s
    q.settle("d", Result.ERROR, 10.0)
    assert 10.25 <= q.get("d").not_before <= 10.5
    assert [j for j, _ in q.due(10.05)] == ["c"] or q.get("b").not_before == 10.05
    assert "d" not in [j for j, _ in q.due(10.2)]
    assert q.next_due() == q.get("c").not_before
    assert q.settle("c", Result.UNPLANNABLE, 10.1) is Action.FORGET and "c" not in q
    for _ in range(12):  # the backoff is capped
        q.settle("b", Result.ETCD_ERROR, 10.0)
    assert q.get("b").not_before <= 12.0


def test_operator_marks_are_coalesced_and_a_failure_is_not():
    q = WorkQueue(coalesce_s=0.25)
    q.mark("j", "drain", at=1.0, now=100.0)
    assert q.get("j").not_before == 100.25
    q.mark("j", "gpu_failed", at=1.1, now=100.1)
    assert q.get("j").not_before == 0.0 and q.get("j").cause == "drain"


def test_lost_cas_rereads_that_job_only(etcd_server, etcd, caplog):
    caplog.set_level(logging.INFO, logger="tpflex_controller.reconcile")
    with controller_on_job(etcd_server, etcd) as (_, watcher, ctl):
        first = watcher.wait_generation(1)
        rec = ctl.reconciler
        rec._unregister()  # the view stops seeing etcd: what it holds goes stale
        kv = etcd.get(keys.job_plan("job1"))
        etcd.put(keys.job_plan("job1"), kv.value)  # the plan key moves under the view
        fail_gpu(etcd, "rack1-n01", 2, {1})
        health = etcd.get(keys.health("rack1-n01"))
        # the failure reaches the loop the way the informer would deliver it
        change = decode_change(Op.PUT, health.key, health.value, health.mod_revision)
        rec._inbox.put(("informer", Batch((change,), health.mod_revision), time.time()))
        second = watcher.wait_generation(2)
        assert second.cause == "gpu_failed" and [r.tp_degree for r in second.replicas] == [4, 3]
        assert first.generation == 1
        sample = ctl.registry.get_sample_value
        # counted once the loop settles the commit (just after the watcher saw it)
        eventually(lambda: sample("tpflex_reconcile_total", {"result": "ok"}) >= 2)
        assert sample("tpflex_reconcile_total", {"result": "conflict"}) == 1
    loads = [r for r in caplog.records if r.getMessage().startswith("controller state loaded")]
    rereads = [r for r in caplog.records if r.getMessage().startswith("job re-read after conflict job=job1")]
    assert len(loads) == 1 and len(rereads) == 1  # no whole re-read of /tpflex/v1/
