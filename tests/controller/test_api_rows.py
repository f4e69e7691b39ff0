"""The list endpoints' per-node rows (api/rows.py): what the cached app lists equals the
whole-cluster derivation (``views.gpu_views`` over one etcd snapshot, the reference) after
every kind of change, pages walk the same list, a change re-renders only its node, and the
row cache keeps at most its bound."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.api import views
from tpflex_controller.api.rows import RowCache
from tpflex_controller.api.state import read_cluster
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h
from tests.controller.test_api_cache import _cached_app, _caught_up


def _reference(store: Store) -> tuple[list[dict], list[dict], dict]:
    snap = read_cluster(store)
    gpus = views.gpu_views(snap)
    names = views.node_names(snap)
    nodes = [views.node_view(n, names[n], snap, [g for g in gpus if g.node == n]).model_dump(mode="json")
             for n in sorted(names)]
    return [g.model_dump(mode="json") for g in gpus], nodes, views.count_states(gpus).model_dump()


def _walk(http: httpx.Client, path: str, limit: int) -> list[dict]:
    out, after = [], None
    while True:
        params = {"limit": limit, **({"after": after} if after else {})}
        resp = http.get(path, params=params)
        assert resp.status_code == 200, resp.text
        out += resp.json()
        after = resp.headers.get("X-Next-Cursor")
        if after is None:
            return out


def _check(http: httpx.Client, store: Store) -> None:
    gpus, nodes, counts = _reference(store)
    assert http.get("/v1/gpus").json() == gpus
    assert _walk(http, "/v1/gpus", 3) == gpus
    assert http.get("/v1/gpus", params={"state": "failed"}).json() == [g for g in gpus if g["state"] == "failed"]
    assert http.get("/v1/gpus", params={"rack": "rack-b"}).json() == [g for g in gpus if g["rack"] == "rack-b"]
    assert http.get("/v1/nodes").json() == nodes and _walk(http, "/v1/nodes", 1) == nodes
    assert http.get("/v1/status").json()["gpus"] == counts
    snap = read_cluster(store)
    racks = [views.rack_view(snap.racks[name], [views.s.GpuView(**g) for g in gpus if g["rack"] == name])
             .model_dump(mode="json") for name in sorted(snap.racks)]
    assert http.get("/v1/racks").json() == racks  # the whole-cluster derivation, the reference
    assert _walk(http, "/v1/racks", 1) == racks
    assert {r["name"] for r in racks} >= set(h.RACKS)


def test_listed_rows_equal_the_whole_cluster_derivation_after_each_change(etcd, tmp_path):
    store = Store(etcd)
    h.seed(store, registered_missing="rack-b-n0")
    with _cached_app(etcd, tmp_path) as (cache, http):
        _caught_up(cache, etcd)
        _check(http, store)
        untouched = cache.node_row("rack-a-n0")
        changes = [
            lambda: h.put_health(store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")}),
            lambda: etcd.put(keys.gpu_override("rack-b-n1", 1), codec.encode(types_pb2.GpuOverride(
                gpu=types_pb2.GpuRef(node="rack-b-n1", index=1), drained=True, reason="maint"))),
            lambda: etcd.put(keys.gpu_hold("rack-b-n1", 3), codec.encode(types_pb2.GpuHold(
                gpu=types_pb2.GpuRef(node="rack-b-n1", index=3), until=h.NOW + 30, reason="flap hold-down"))),
            lambda: h.register(store, "rack-b", "rack-b-n0"),
            lambda: etcd.delete(keys.node("rack-a-n1")),
            lambda: h.put_health(store, "rack-a-n1", {}),
            lambda: etcd.delete(keys.gpu_hold("rack-b-n1", 3)),
            # an unlisted node (rack-b lists rack-b-n0 ... but not this one) naming a rack,
            # then naming the other: its GPUs move between the racks' counts
            lambda: h.register(store, "rack-a", "extra-n9"),
            lambda: h.put_health(store, "extra-n9", {0: (types_pb2.GPU_FAILED, "xid 48")}),
            lambda: h.register(store, "rack-b", "extra-n9"),
            lambda: etcd.delete(keys.node("extra-n9")),
            lambda: etcd.put(keys.rack("rack-c"), codec.encode(types_pb2.Rack(
                name="rack-c", gpus_per_node=2, nodes=["rack-c-n0"], power_budget_w=900))),
        ]
        for change in changes:
            change()
            _caught_up(cache, etcd)
            _check(http, store)
        assert cache.node_row("rack-a-n0") is untouched  # no change of its: not re-rendered
        rack = codec.decode(types_pb2.Rack, etcd.get(keys.rack("rack-a")).value)
        rack.power_budget_w += 100  # a rack change re-renders its nodes
        etcd.put(keys.rack("rack-a"), codec.encode(rack))
        _caught_up(cache, etcd)
        assert cache.node_row("rack-a-n0") is not untouched
        _check(http, store)


def test_the_row_cache_keeps_at_most_its_bound():
    cache = RowCache(max_nodes=2)
    built = []

    def build(name):
        built.append(name)
        return None

    for name in ("a", "b", "a", "c", "a", "b"):
        cache.get(name, 1, lambda name=name: build(name))
        assert len(cache) <= 2
    assert built == ["a", "b", "c", "b"]  # "a" stayed (recently used), "b" was evicted by "c"
    cache.get("a", 2, lambda: build("a"))  # a new version of the node: rendered again
    assert built[-1] == "a"


def test_the_plan_render_memo_keeps_at_most_its_bound():
    from tpflex_controller.api.memo import RenderMemo

    memo = RenderMemo(max_entries=2)
    renders = []

    def render(name):
        renders.append(name)
        return views.s.Health(status=name)

    sources = {name: object() for name in "abc"}
    for name in "abcab":
        memo.json("plan", name, sources[name], lambda name=name: render(name))
        assert len(memo._kept) <= 2
    assert renders == ["a", "b", "c", "a", "b"]  # a job's plan left the memo when c came
    memo.json("plan", "b", sources["b"], lambda: render("b"))
    assert renders[-1] == "b" and len(renders) == 5  # kept: not rendered again


def test_the_fast_plan_json_equals_the_models_json():
    """views.plan_json (built from the protobuf) against views.plan_view (the pydantic
    models, the reference) on a plan with a degraded, boosted replica, reasons and a
    suspended pin."""
    import dataclasses
    import json

    from tpflex_controller import convert, synthetic
    from tpflex_controller.planner import plan
    from tpflex_controller.planner.model import GpuStatus, JobOverrides
    from tpflex_controller.store import Snapshot

    racks = [synthetic.rack(f"r{i}", 2, 4) for i in range(3)]
    snap = Snapshot(racks={r.name: r for r in racks},
                    nodes={n: synthetic.node(n, r.name, 4) for r in racks for n in r.nodes})
    state = convert.cluster_state(snap)
    state = dataclasses.replace(state, gpu_status={("r1-n00", 2): GpuStatus.FAILED, ("r2-n01", 0): GpuStatus.FAILED})
    spec = convert.job_spec(synthetic.job("j", [r.name for r in racks], 8), state.racks)
    result = plan(state, spec, overrides=JobOverrides(pins={2: 8}))
    proto = convert.plan_to_proto(result, 7, cause="gpu_failed")
    assert proto.power_caps and proto.suspended_pins and proto.reasons  # the plan exercises every field
    assert {r.state for r in proto.replicas} >= {types_pb2.REPLICA_HEALTHY, types_pb2.REPLICA_DEGRADED}
    assert json.loads(views.plan_json(proto)) == views.plan_view(proto).model_dump(mode="json")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_one_nodes_gpus_equal_the_whole_cluster_views_filtered_to_it(data):
    """``views.gpu_views(snap, node=n)`` (and ``gpu_locations(snap, n)``), the one-node
    derivation the rows use, against the whole-cluster views filtered to ``n``: racks
    listing overlapping nodes, registered nodes naming listed or unlisted racks, health
    and drains."""
    from tpflex_controller.store import Snapshot

    names = [f"n{i}" for i in range(5)]
    racks = {}
    for r in range(data.draw(st.integers(0, 3))):
        listed = data.draw(st.lists(st.sampled_from(names), max_size=4))
        racks[f"r{r}"] = types_pb2.Rack(name=f"r{r}", gpus_per_node=data.draw(st.integers(0, 3)), nodes=listed)
    snap = Snapshot(racks=racks)
    for n in data.draw(st.lists(st.sampled_from(names), unique=True)):
        rack = data.draw(st.sampled_from([*racks, "elsewhere"]))
        devs = [types_pb2.GpuDevice(index=i, uuid=f"{n}-{i}") for i in data.draw(st.sets(st.integers(0, 4)))]
        snap.nodes[n] = types_pb2.Node(name=n, rack=rack, gpus=devs)
        failed = data.draw(st.sets(st.integers(0, 4)))
        snap.health[n] = types_pb2.NodeHealth(node=n, gpus=[
            types_pb2.GpuHealth(index=i, state=types_pb2.GPU_FAILED, reason="x") for i in sorted(failed)])
    for n, i in data.draw(st.lists(st.tuples(st.sampled_from(names), st.integers(0, 4)), max_size=3)):
        snap.gpu_overrides[(n, i)] = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node=n, index=i), drained=True)
    whole = views.gpu_views(snap)
    locations = views.gpu_locations(snap)
    for n in names:
        assert views.gpu_locations(snap, n) == {g: r for g, r in locations.items() if g[0] == n}
        assert views.gpu_views(snap, node=n) == [g for g in whole if g.node == n]


def test_the_memo_keeps_a_value_while_every_source_is_the_same_object():
    from tpflex_controller.api.memo import RenderMemo

    memo, made = RenderMemo(max_entries=4), []
    spec, plan = object(), object()

    def make(tag):
        made.append(tag)
        return tag

    assert memo.value("status", "j", (spec, plan), lambda: make(1)) == 1
    assert memo.value("status", "j", (spec, plan), lambda: make(2)) == 1  # same objects: kept
    assert memo.value("status", "j", (spec, object()), lambda: make(3)) == 3  # a new plan object
    assert memo.value("status", "j", (spec, None), lambda: make(4)) == 4  # the plan went
    assert memo.value("status", "k", (spec, None), lambda: make(5)) == 5  # per name
    assert made == [1, 3, 4, 5]
