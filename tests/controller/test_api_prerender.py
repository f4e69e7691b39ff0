"""The REST process's background renders (api/prerender.py): after a change, the rows,
the status index and the rack views the list pages serve are made before anyone asks, so
that the first requests after a quiet spell find them (real etcd, real uvicorn); what the
pages answer stays the whole-cluster derivation. Also the plan memo's single flight and
the plan JSON's per-replica pieces."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.api import create_app, views
from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.api.memo import RenderMemo
from tpflex_controller.api.prerender import Prerenderer
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h
from tests.controller.api_harness import ServedApp, make_deps, write_token_file
from tests.controller.test_api_rows import _check


@contextmanager
def _served(etcd, tmp_path, *, prerender: bool = True):
    """The REST process's wiring (api/process.py): the cache's warm-up ends with
    ``render_all``, and the prerenderer follows each change."""
    started: list[Prerenderer] = []
    warmed = threading.Event()

    def on_warm() -> None:
        if started:
            started[0].render_all()
        warmed.set()

    cache = ApiStateCache(etcd, retry_s=0.05, on_warm=on_warm)
    if prerender:
        started.append(Prerenderer(cache, settle_s=0.01).start())
    cache.start()
    deps = make_deps(etcd, write_token_file(tmp_path))
    deps.state = cache
    server = ServedApp(create_app(deps)).start()
    http = httpx.Client(base_url=server.url, timeout=10.0)
    try:
        assert warmed.wait(10)
        yield cache, deps.memo, (started[0] if started else None), http
    finally:
        http.close()
        server.stop()
        for p in started:
            p.stop()
        cache.stop()


def _new_generation(store: Store, generation: int) -> types_pb2.Plan:
    plan = h.make_plan(store, generation)
    plan.cause = f"generation-{generation}"
    store.etcd.put(keys.job_plan(h.JOB), codec.encode(plan))
    return plan


def _settled(cache: ApiStateCache, prerender: Prerenderer | None, etcd) -> None:
    revision = etcd.status().header.revision
    assert cache.wait_revision(revision, timeout=10)
    if prerender is not None:
        assert prerender.wait_revision(revision, timeout=10)


def test_the_warm_up_and_each_change_render_before_anyone_asks(etcd, tmp_path):
    store = Store(etcd)
    h.seed(store)
    with _served(etcd, tmp_path) as (cache, memo, prerender, http):
        _settled(cache, prerender, etcd)
        # the warm-up rendered every row and rack: the first requests render none
        rows, racks = cache.rows.built, cache.racks_rendered
        assert http.get("/v1/racks").status_code == 200 and http.get("/v1/status").status_code == 200
        assert (cache.rows.built, cache.racks_rendered) == (rows, racks)
        changes = [
            lambda: h.put_health(store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")}),
            lambda: etcd.put(keys.gpu_override("rack-b-n1", 1), codec.encode(types_pb2.GpuOverride(
                gpu=types_pb2.GpuRef(node="rack-b-n1", index=1), drained=True, reason="maint"))),
            lambda: h.register(store, "rack-a", "extra-n9"),  # an unlisted node naming a rack
            lambda: h.put_health(store, "extra-n9", {0: (types_pb2.GPU_FAILED, "xid 48")}),
        ]
        for change in changes:
            change()
            _settled(cache, prerender, etcd)
            rows, racks = cache.rows.built, cache.racks_rendered
            # the index, the rows and the racks were current before these requests
            assert http.get("/v1/status").status_code == 200
            assert http.get("/v1/racks").status_code == 200
            assert http.get("/v1/gpus", params={"state": "failed"}).status_code == 200
            assert (cache.rows.built, cache.racks_rendered) == (rows, racks)
            _check(http, store)  # and what they answer is the whole-cluster derivation
        for generation in (2, 3):  # plans: rendered by their first reader, once
            _new_generation(store, generation)
            _settled(cache, prerender, etcd)
            plan = cache.plan(h.JOB)
            assert plan.generation == generation
            before = memo.peek("plan", h.JOB)
            assert before is None or before[0] is not plan
            resp = http.get(f"/v1/jobs/{h.JOB}/plan")
            kept = memo.peek("plan", h.JOB)
            assert kept[0] is plan and resp.content == kept[1]
            assert resp.json() == views.plan_view(plan).model_dump(mode="json")


def test_without_the_prerenderer_the_first_requests_render(etcd, tmp_path):
    """The counterpart: what the test above sees made beforehand is otherwise made by the
    first request (so its check can fail)."""
    store = Store(etcd)
    h.seed(store)
    with _served(etcd, tmp_path, prerender=False) as (cache, memo, _, http):
        _settled(cache, None, etcd)
        assert http.get("/v1/racks").status_code == 200  # every rack rendered once
        h.put_health(store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")})
        _settled(cache, None, etcd)
        rows, racks = cache.rows.built, cache.racks_rendered
        assert http.get("/v1/status").status_code == 200
        assert cache.rows.built == rows + 1
        assert http.get("/v1/racks").status_code == 200
        assert cache.racks_rendered == racks + 1


def test_a_plan_is_rendered_once_by_concurrent_askers():
    memo = RenderMemo()
    source = object()
    entered, release = threading.Event(), threading.Event()
    renders = []

    def render() -> bytes:
        renders.append(1)
        entered.set()
        assert release.wait(10)
        return b'{"x":1}'

    got: list[bytes] = []
    first = threading.Thread(target=lambda: got.append(memo.body("plan", "j", source, render)))
    first.start()
    assert entered.wait(10)
    others = [threading.Thread(target=lambda: got.append(memo.body("plan", "j", source, render)))
              for _ in range(3)]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert got == [b'{"x":1}'] * 4 and len(renders) == 1
    memo.body("plan", "j", object(), lambda: b"new")  # another plan object: rendered again
    assert memo.peek("plan", "j")[1] == b"new"


def test_a_failed_render_lets_the_next_asker_render():
    memo = RenderMemo()
    source = object()

    def broken() -> bytes:
        raise RuntimeError("boom")

    try:
        memo.body("plan", "j", source, broken)
    except RuntimeError:
        pass
    assert memo.body("plan", "j", source, lambda: b"ok") == b"ok"


_names = st.text(alphabet="abc-0é✓\"\\", min_size=1, max_size=6)
_gpus = st.lists(st.builds(types_pb2.GpuRef, node=_names, index=st.integers(0, 7)), max_size=4)
_stages = st.lists(st.builds(types_pb2.StagePlan, rack=_names, tp_degree=st.integers(0, 8),
                             spec_stage=st.integers(0, 2), gpus=_gpus), max_size=2)
_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
_replicas = st.lists(st.builds(
    types_pb2.ReplicaPlan, index=st.integers(0, 9), state=st.sampled_from(list(views._REPLICA_STATE)),
    stages=_stages, tp_degree=st.integers(0, 8), local_batch=st.integers(0, 64),
    relative_throughput=_floats, reason=_names), max_size=4)


@settings(max_examples=150, deadline=None)
@given(replicas=_replicas, reasons=st.lists(_names, max_size=2), ratio=_floats,
       caps=st.lists(st.builds(types_pb2.PowerCap, gpu=st.builds(types_pb2.GpuRef, node=_names,
                                                                   index=st.integers(0, 7)),
                               cap_w=_floats), max_size=3),
       pins=st.lists(st.builds(types_pb2.SuspendedPin, replica=st.integers(0, 9),
                               tp_degree=st.integers(1, 8), reason=_names), max_size=2))
def test_the_plan_json_from_replica_pieces_equals_the_models_json(replicas, reasons, ratio, caps, pins):
    """``views.plan_json`` (each replica's JSON kept by its encoding) against the pydantic
    models (the reference), and the same bytes whether its pieces were kept or not."""
    plan = types_pb2.Plan(job="j", generation=3, policy="ntp-pw", expected_throughput_ratio=ratio,
                          reasons=reasons, replicas=replicas, power_caps=caps, suspended_pins=pins,
                          created_at=1.5, cause="gpu_failed")
    body = views.plan_json(plan)
    assert json.loads(body) == views.plan_view(plan).model_dump(mode="json")
    views._replica_json.cache_clear()
    assert views.plan_json(plan) == body


def test_a_new_generation_renders_only_its_changed_replicas():
    def replica(i: int, tp: int) -> types_pb2.ReplicaPlan:
        return types_pb2.ReplicaPlan(index=i, tp_degree=tp, stages=[types_pb2.StagePlan(
            rack=f"r{i}", tp_degree=tp, gpus=[types_pb2.GpuRef(node=f"r{i}-n0", index=g) for g in range(tp)])])

    def cap(i: int, watts: float) -> types_pb2.PowerCap:
        return types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=f"r{i}-n0", index=0), cap_w=watts)

    plan = types_pb2.Plan(job="j", generation=1, replicas=[replica(i, 4) for i in range(6)],
                          power_caps=[cap(i, 900.0) for i in range(6)])
    views.plan_json(plan)
    before = views._replica_json.cache_info().misses, views._cap_json.cache_info().misses
    plan.generation = 2
    plan.replicas[3].CopyFrom(replica(3, 3))  # one replica lost a GPU, its rack boosted
    plan.power_caps[3].cap_w = 1100.0
    body = views.plan_json(plan)
    assert (views._replica_json.cache_info().misses, views._cap_json.cache_info().misses) == (
        before[0] + 1, before[1] + 1)
    assert json.loads(body) == views.plan_view(plan).model_dump(mode="json")
