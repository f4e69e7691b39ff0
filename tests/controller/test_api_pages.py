"""Cursor pagination of the list endpoints (limit, after, X-Next-Cursor, Link)."""

from __future__ import annotations

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
