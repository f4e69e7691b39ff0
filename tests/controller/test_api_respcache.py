"""The REST process's response cache (api/respcache.py) and the cluster index behind
/v1/status (api/index.py): a response changes right after the view folds a change of what
it renders, an unrelated change does not re-render it, concurrent misses share one render,
and the index equals a walk over every node's row."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import httpx
from tpflex_controller.api import create_app
from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.api.deps import TokenConfig
from tpflex_controller.api.index import NodeIndex
from tpflex_controller.api.respcache import ResponseCache, ResponseCacheCollector, resource_of
from tpflex_controller.api.rows import STATES, NodeRow, counts_view
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h
from tests.controller.api_harness import ServedApp, make_deps, write_token_file

# ---- pure parts ----


def _row(rng: random.Random, name: str) -> NodeRow:
    states = [rng.choice(STATES) for _ in range(4)]
    counts = tuple(states.count(st) for st in STATES)
    return NodeRow(name=name, rack="r", live=rng.random() < 0.8, gpus=(), counts=counts, json=b"{}",
                   states=frozenset(states), racks=frozenset({"r"}))


def test_node_index_equals_a_walk_over_every_row():
    rng = random.Random(3)
    index, current = NodeIndex(), {}
    for _ in range(300):
        changed = []
        for name in rng.sample([f"n{i}" for i in range(40)], rng.randint(1, 6)):
            row = None if rng.random() < 0.2 else _row(rng, name)
            changed.append((name, row))
            current.pop(name, None) if row is None else current.__setitem__(name, row)
        index.apply(changed)
        nodes, live, counts = index.totals()
        walk = counts_view(current.values())
        assert (nodes, live) == (len(current), sum(r.live for r in current.values()))
        assert counts == (walk.healthy, walk.degraded, walk.failed, walk.drained)
        for st in STATES:
            assert index.nodes_in_state(st) == sorted(n for n, r in current.items() if st in r.states)


def test_resource_of_cached_paths():
    assert resource_of("/v1/status") == ("all", "")
    assert resource_of("/v1/jobs/j1") == ("job+goodput", "j1")
    assert resource_of("/v1/jobs/j1/plan") == ("job", "j1")
    assert resource_of("/v1/nodes/n1") == ("node", "n1")
    assert resource_of("/v1/nodes/n1/gpus/2") == ("node", "n1")
    for p in ("/v1/gpus", "/v1/nodes", "/v1/racks", "/v1/racks/r1"):
        assert resource_of(p) == ("cluster", "")
    for p in ("/v1/jobs", "/v1/jobs/j1/plans", "/v1/events", "/healthz", "/v1/jobs//plan", "/v2/status"):
        assert resource_of(p) is None


def test_concurrent_misses_share_one_render():
    """20 requests for the same page and version while its render is in progress: one
    render, 19 shared; after a version change, one more render."""
    renders, release = [], asyncio.Event()
    state = SimpleNamespace(version=lambda resource, name: (1, ver[0]))
    ver = [1]

    async def app(scope, receive, send):
        renders.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-v", str(ver[0]).encode())]})
        await send({"type": "http.response.body", "body": f"v{ver[0]}".encode()})

    deps = SimpleNamespace(state=state, tokens=TokenConfig(), steps=None, response_stats={})
    cache = ResponseCache(app, deps=deps)

    async def get() -> bytes:
        out = []

        async def send(m):
            out.append(m)

        await cache({"type": "http", "method": "GET", "path": "/v1/jobs/j/plan", "query_string": b"",
                     "headers": []}, None, send)
        assert out[0]["status"] == 200
        return out[1]["body"]

    async def main():
        tasks = [asyncio.ensure_future(get()) for _ in range(20)]
        await asyncio.sleep(0.05)  # every request is waiting on the one render
        assert len(renders) == 1
        release.set()
        assert set(await asyncio.gather(*tasks)) == {b"v1"}
        assert await get() == b"v1"
        ver[0] = 2
        assert await get() == b"v2"

    asyncio.run(main())
    assert len(renders) == 2
    assert deps.response_stats == {"hits": 1, "renders": 2, "shared": 19, "uncached": 0}
    [family] = ResponseCacheCollector(deps.response_stats).collect()
    assert {s.labels["result"]: s.value for s in family.samples if s.name.endswith("_total")} == {
        "hits": 1.0, "renders": 2.0, "shared": 19.0, "uncached": 0.0}


# ---- against a real etcd, real uvicorn, real HTTP ----


def _served(etcd, tmp_path, *, protect_reads=False):
    cache = ApiStateCache(etcd, retry_s=0.05).start()
    deps = make_deps(etcd, write_token_file(tmp_path), protect_reads=protect_reads)
    deps.state = cache
    server = ServedApp(create_app(deps)).start()
    return cache, deps, server


def test_a_response_follows_its_data_and_ignores_unrelated_changes(etcd, tmp_path):
    store = Store(etcd)
    h.seed(store)
    cache, deps, server = _served(etcd, tmp_path)
    stats = deps.response_stats
    node = h.node_name(h.RACKS[0], 1)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert cache.wait_revision(etcd.status().header.revision, 10)
            pages = [f"/v1/jobs/{h.JOB}", f"/v1/jobs/{h.JOB}/plan", "/v1/status", f"/v1/nodes/{node}",
                     "/v1/gpus?state=failed"]
            first = {p: http.get(p).json() for p in pages}
            renders = stats["renders"]
            assert {p: http.get(p).json() for p in pages} == first
            assert stats["renders"] == renders and stats["hits"] >= len(pages)  # nothing changed

            # a GPU fails: the node, the GPU list and the status change at once; the job
            # pages (no plan was committed) are not rendered again
            h.put_health(store, node, {2: (types_pb2.GPU_FAILED, "xid 79")})
            assert cache.wait_revision(etcd.status().header.revision, 10)
            renders = stats["renders"]
            after = {p: http.get(p).json() for p in pages}
            assert stats["renders"] == renders + 3
            assert after[f"/v1/jobs/{h.JOB}"] == first[f"/v1/jobs/{h.JOB}"]
            assert after[f"/v1/jobs/{h.JOB}/plan"] == first[f"/v1/jobs/{h.JOB}/plan"]
            assert after["/v1/status"]["gpus"]["failed"] == first["/v1/status"]["gpus"]["failed"] + 1
            assert after["/v1/status"]["etcd_revision"] > first["/v1/status"]["etcd_revision"]
            assert [g["state"] for g in after["/v1/gpus?state=failed"]] == ["failed"]
            assert after[f"/v1/nodes/{node}"]["gpus"]["failed"] == 1

            # a new plan generation: the job's pages change right after the view folds it
            plan = h.make_plan(store, generation=2)
            etcd.put(keys.job_plan(h.JOB), codec.encode(plan))
            assert cache.wait_revision(etcd.status().header.revision, 10)
            assert http.get(f"/v1/jobs/{h.JOB}/plan").json()["generation"] == 2
            assert http.get(f"/v1/jobs/{h.JOB}").json()["plan"]["generation"] == 2
            # the recovery: the status and the failed list follow again
            h.put_health(store, node, {})
            assert cache.wait_revision(etcd.status().header.revision, 10)
            assert http.get("/v1/status").json()["gpus"] == first["/v1/status"]["gpus"]
            assert http.get("/v1/gpus?state=failed").json() == []
    finally:
        server.stop()
        cache.stop()


def test_a_cached_page_keeps_the_link_of_the_host_asked(etcd, tmp_path):
    h.seed(Store(etcd))
    cache, deps, server = _served(etcd, tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert cache.wait_revision(etcd.status().header.revision, 10)
            port = server.url.rsplit(":", 1)[1]
            for host in ("127.0.0.1", "localhost", "127.0.0.1"):
                resp = http.get("/v1/nodes?limit=1", headers={"Host": f"{host}:{port}"})
                assert resp.status_code == 200
                assert resp.headers["Link"].startswith(f"<http://{host}:{port}/v1/nodes?"), resp.headers
            assert deps.response_stats["hits"] == 1 and deps.response_stats["renders"] == 2
    finally:
        server.stop()
        cache.stop()


def test_cached_reads_still_need_a_token_when_reads_are_protected(etcd, tmp_path):
    h.seed(Store(etcd))
    cache, deps, server = _served(etcd, tmp_path, protect_reads=True)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert cache.wait_revision(etcd.status().header.revision, 10)
            for _ in range(2):
                assert http.get("/v1/status", headers=h.reader()).status_code == 200
            assert deps.response_stats["hits"] >= 1
            assert http.get("/v1/status").status_code == 401
            assert http.get("/v1/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    finally:
        server.stop()
        cache.stop()


def test_status_counts_equal_a_walk_while_gpus_change(etcd, tmp_path):
    """The index folded from changes equals the etcd-per-request walk after each change."""
    store = Store(etcd)
    h.seed(store)
    cache = ApiStateCache(etcd, retry_s=0.05).start()
    reference = make_deps(etcd, write_token_file(tmp_path)).reads  # EtcdState: a full walk
    rng = random.Random(5)
    nodes = [h.node_name(r, i) for r in h.RACKS for i in range(h.NODES_PER_RACK)]
    try:
        for _ in range(12):
            node = rng.choice(nodes)
            failed = {i: (types_pb2.GPU_FAILED, "xid") for i in range(h.GPUS_PER_NODE) if rng.random() < 0.4}
            h.put_health(store, node, failed)
            if rng.random() < 0.3:
                etcd.delete(keys.node(rng.choice(nodes)))
            assert cache.wait_revision(etcd.status().header.revision, 10)
            assert cache.status_counts() == reference.status_counts()
            assert cache.nodes_in_state("failed") == sorted(
                n for n, r in zip(nodes, reference.node_rows(nodes), strict=True) if r and "failed" in r.states)
    finally:
        cache.stop()
