"""Cursor pagination of the list endpoints (limit, after, X-Next-Cursor, Link)."""

from __future__ import annotations

from tpflex_proto import types_pb2

from tests.controller import api_harness as h


def _walk(api, path: str, limit: int, **params) -> tuple[list, int]:
    """Every item of ``path`` page by page, and the number of pages."""
    items, after, pages = [], None, 0
    while True:
        q = {"limit": limit, **params, **({"after": after} if after else {})}
        r = api.http.get(path, params=q)
        assert r.status_code == 200, r.text
        assert len(r.json()) <= limit
        items += r.json()
        pages += 1
        after = r.headers.get("X-Next-Cursor")
        if after is None:
            assert "Link" not in r.headers
            return items, pages
        assert 'rel="next"' in r.headers["Link"] and f"limit={limit}" in r.headers["Link"]


def test_pages_cover_every_item_once_in_order(api):
    for path, key in (("/v1/racks", "name"), ("/v1/nodes", "name"), ("/v1/jobs", "name")):
        whole = api.http.get(path).json()
        assert "X-Next-Cursor" not in api.http.get(path).headers  # no limit: everything
        for limit in (1, 2, 3):
            items, pages = _walk(api, path, limit)
            assert [i[key] for i in items] == [i[key] for i in whole]
            assert pages == max(1, -(-len(whole) // limit))
    gpus = api.http.get("/v1/gpus").json()
    assert len(gpus) == len(h.RACKS) * h.NODES_PER_RACK * h.GPUS_PER_NODE
    items, pages = _walk(api, "/v1/gpus", 5)
    assert [(g["node"], g["index"]) for g in items] == [(g["node"], g["index"]) for g in gpus]
    assert pages == 4
    rack_a, _ = _walk(api, "/v1/gpus", 3, rack="rack-a")
    assert {g["rack"] for g in rack_a} == {"rack-a"} and len(rack_a) == h.T


def test_a_cursor_past_the_end_or_between_items_is_stable(api):
    assert api.http.get("/v1/racks", params={"after": "zzz"}).json() == []
    # a cursor that names no item starts after where it would sort
    names = [r["name"] for r in api.http.get("/v1/racks", params={"after": "rack-a0"}).json()]
    assert names == ["rack-b"]


def test_bad_page_parameters_are_422_with_a_message(api):
    for params in ({"limit": 0}, {"limit": 10_001}, {"limit": "ten"}, {"after": "x" * 601}):
        r = api.http.get("/v1/nodes", params=params)
        assert r.status_code == 422, params
        assert r.json()["error"]["code"] == "invalid_request"
        assert list(params)[0] in r.json()["error"]["message"]


def test_gpu_pages_keep_nodes_whose_names_extend_the_cursors_node(api):
    """GPUs page in (node, index) order. A cursor compared as a "node:index" string skips
    every node whose name extends the cursor's node with a digit, "-" or "." (":" sorts
    after them): "p1:0000003" > "p10:0000000"."""
    names = ["p", "p1", "p1-x", "p1.y", "p10", "p11", "p2"]
    api.store.put_rack(types_pb2.Rack(
        name="rack-p", domain_size=len(names) * h.GPUS_PER_NODE, power_budget_w=1e5, gpu_tdp_w=1000.0,
        gpu_min_w=200.0, gpu_max_w=1300.0, nodes=names, gpus_per_node=h.GPUS_PER_NODE))
    for n in names:
        h.register(api.store, "rack-p", n)
        h.put_health(api.store, n, {})
    whole = [(g["node"], g["index"]) for g in api.http.get("/v1/gpus", params={"rack": "rack-p"}).json()]
    assert whole == [(n, i) for n in sorted(names) for i in range(h.GPUS_PER_NODE)]
    for limit in (1, 3, 5):  # cursors at every index of a node, and across nodes
        items, _ = _walk(api, "/v1/gpus", limit, rack="rack-p")
        assert [(g["node"], g["index"]) for g in items] == whole, limit
    everything = [(g["node"], g["index"]) for g in api.http.get("/v1/gpus").json()]
    assert [(g["node"], g["index"]) for g in _walk(api, "/v1/gpus", 7)[0]] == everything
    # a cursor of a node alone (no index) resumes at that node's first GPU
    r = api.http.get("/v1/gpus", params={"rack": "rack-p", "after": "p10", "limit": 1})
    assert [(g["node"], g["index"]) for g in r.json()] == [("p10", 0)]
