"""The API view's folding of plan commits and its warm-up (api/cache.py, api/process.py):
a plan committed as a header and per-replica parts in one transaction is read whole right
after, while its assembly (the costly part: a job's every GPU) does not hold the readers'
lock; after each warm-up the status index is built and ``settle_heap`` moves the view out
of the collector's way. Real etcd, real uvicorn, real HTTP."""

from __future__ import annotations

import gc
import threading

from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.api.process import settle_heap
from tpflex_controller.api.state import EtcdState
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Op

from tests.controller import api_harness as h
from tests.controller.test_api_cache import _cached_app, _caught_up


def _commit_split(etcd, plan: types_pb2.Plan) -> None:
    """``plan`` stored as the controller stores it (tpflex_proto.planstore): a part per
    replica with its GPUs' caps, then the header, in one transaction."""
    header = types_pb2.Plan()
    header.CopyFrom(plan)
    del header.replicas[:]
    del header.power_caps[:]
    header.split, header.stored_replicas = True, len(plan.replicas)
    ops = []
    for i, replica in enumerate(plan.replicas):
        part = types_pb2.Plan()
        part.replicas.add().CopyFrom(replica)
        mine = {(g.node, g.index) for st in replica.stages for g in st.gpus}
        part.power_caps.extend(c for c in plan.power_caps if (c.gpu.node, c.gpu.index) in mine)
        ops.append(Op.put(keys.job_assign(plan.job, plan.generation, i), codec.encode(part)))
    ops.append(Op.put(keys.job_plan(plan.job), codec.encode(header)))
    assert etcd.txn([], ops).succeeded


def test_a_split_plan_commit_is_read_whole_at_once_and_its_assembly_holds_no_reader(
        etcd, tmp_path, monkeypatch):
    first = h.seed(Store(etcd))
    second = types_pb2.Plan()
    second.CopyFrom(first)
    second.generation, second.cause = 2, "gpu_failed"
    second.replicas[0].reason = "changed in generation 2"
    with _cached_app(etcd, tmp_path) as (cache, http):
        _caught_up(cache, etcd)
        page = f"/v1/jobs/{h.JOB}/plan"
        assert http.get(page).json()["generation"] == 1  # rendered and kept by the response cache
        before = cache.version("job", h.JOB)

        real_whole, seen = planstore.whole, {}

        def whole(*args, **kw):  # while the informer's thread assembles the new plan
            reader = threading.Thread(target=lambda: seen.setdefault("version", cache.version("job", h.JOB)))
            reader.start()
            reader.join(5)
            seen.setdefault("answered", not reader.is_alive())
            return real_whole(*args, **kw)

        monkeypatch.setattr(planstore, "whole", whole)
        _commit_split(etcd, second)
        _caught_up(cache, etcd)
        # a reader was answered during the assembly, and saw the state before the commit
        assert seen == {"version": before, "answered": True}
        monkeypatch.setattr(planstore, "whole", real_whole)

        stored = planstore.read_plan(etcd, h.JOB)  # the reference: etcd, assembled apart
        assert stored.generation == 2 and not stored.split
        assert cache.plan(h.JOB) == stored
        body = http.get(page).json()
        assert body["generation"] == 2 and body["replicas"][0]["reason"] == "changed in generation 2"
        assert http.get(f"/v1/jobs/{h.JOB}").json()["plan"]["generation"] == 2

        etcd.put(keys.job_plan(h.JOB), b"\xff\xff\xff")  # malformed: the plan read stays
        _caught_up(cache, etcd)
        assert cache.plan(h.JOB) == stored and http.get(page).json()["generation"] == 2

        etcd.delete(keys.job_plan(h.JOB))
        _caught_up(cache, etcd)
        assert cache.plan(h.JOB) is None and http.get(page).status_code == 404


def test_after_the_warm_up_the_status_index_is_built_and_the_view_can_be_frozen(etcd):
    store = Store(etcd)
    h.seed(store)
    h.put_health(store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")})
    warmed = threading.Event()
    cache = ApiStateCache(etcd, on_warm=warmed.set).start()
    try:
        assert warmed.wait(10)
        _caught_up(cache, etcd)
        names = cache.node_names()
        assert len(cache.rows) == len(names) == 4  # every node's rows rendered
        assert cache._index.epoch == cache._t.epoch  # the index of this list, built
        assert cache.status_counts() == EtcdState(store).status_counts()

        row = cache.node_row(names[0])
        assert gc.is_tracked(row) and any(o is row for o in gc.get_objects())
        thresholds = gc.get_threshold()
        try:
            settle_heap()
            assert gc.get_freeze_count() > 0
            # collections no longer walk the view (the permanent generation is not scanned)
            assert not any(o is row for o in gc.get_objects())
            assert cache.node_row(names[0]) is row  # and it is still served
            # no automatic full collection any more: many young collections, none full
            fulls = gc.get_stats()[2]["collections"]
            for _ in range(50):
                gc.collect(1)
            assert gc.get_stats()[2]["collections"] == fulls and gc.get_threshold()[2] >= 100_000
        finally:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
    finally:
        cache.stop()


def test_full_collections_run_on_their_timer_and_free_old_cycles():
    """``FullCollections``: with automatic full collections off (``settle_heap``), a
    cycle that reached the old generation is freed by the timer's collection."""
    import weakref

    from tpflex_controller.api.process import FullCollections

    class Node:
        pass

    thresholds = gc.get_threshold()
    keeper = None
    try:
        gc.set_threshold(thresholds[0], thresholds[1], 1_000_000)
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle
        gone = weakref.ref(a)
        gc.collect(1)
        gc.collect(1)  # promoted to the old generation
        del a, b
        gc.collect(1)  # young collections do not reach it
        assert gone() is not None
        keeper = FullCollections(interval_s=0.05).start()
        assert keeper.wait_runs(1, 10)
        assert gone() is None
    finally:
        if keeper is not None:
            keeper.stop()
        gc.set_threshold(*thresholds)
