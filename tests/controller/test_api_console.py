"""The console's endpoints on the API served over the watch-fed view (real etcd, real
uvicorn, real HTTP): the page and its headers, token checks, the live stream's first
snapshot and its updates, dry-run pins and plan diffs."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from tpflex_controller.api import create_app
from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.api.console import live, routes
from tpflex_controller.api.deps import anonymous_name
from tpflex_controller.api.feed import Change, Kind
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.controller import api_harness as h
from tests.support.etcd_server import EtcdCluster
from tests.support.wait import wait_until


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    base = tmp_path_factory.mktemp("console-api")
    cluster = EtcdCluster(1, base / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    deps = h.make_deps(etcd, h.write_token_file(base))
    deps.state = ApiStateCache(etcd).start()
    server = h.ServedApp(create_app(deps)).start()
    http = httpx.Client(base_url=server.url, timeout=10.0)
    try:
        yield h.Served(etcd, Store(etcd), server, http), deps.state
    finally:
        http.close()
        server.stop()
        deps.state.stop()
        etcd.close()
        cluster.stop()


@pytest.fixture
def api(console):
    served, cache = console
    served.plan = h.seed(served.store)
    rev = served.etcd.status().header.revision
    assert cache.wait_revision(rev, 10)
    return served


def test_the_page_holds_no_data_and_forbids_foreign_scripts(api):
    page = api.http.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["referrer-policy"] == "no-referrer" and page.headers["cache-control"] == "no-store"
    assert "rack-a" not in page.text
    assert api.http.get("/ui/console.js").headers["content-type"].startswith("text/javascript")
    missing = api.http.get("/ui/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_the_console_endpoints_need_a_known_token_even_with_open_reads(api):
    assert api.http.get("/v1/racks").status_code == 200  # protect_reads is off here
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        for path in ("/v1/console/session", "/v1/console/stream"):
            r = api.http.get(path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, headers)
    # the harness's token files list bare tokens: named by their SHA-256 (docs/api.md)
    assert api.http.get("/v1/console/session", headers=h.reader()).json() == {
        "scope": "read-only", "name": anonymous_name(h.READER)}
    assert api.http.get("/v1/console/session", headers=h.admin()).json() == {
        "scope": "admin", "name": anonymous_name(h.ADMIN)}


def _messages(http: httpx.Client, headers: dict, out: list, stop: threading.Event) -> None:
    with http.stream("GET", "/v1/console/stream", headers=headers) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
            if stop.is_set():
                return


def test_the_stream_sends_a_snapshot_then_only_what_changed(api):
    got: list = []
    stop = threading.Event()
    reader = threading.Thread(target=_messages, args=(api.http, h.reader(), got, stop), daemon=True)
    reader.start()
    try:
        wait_until(lambda: got, 10, "the snapshot")
        name, snap = got[0]
        assert name == "snapshot" and snap["scope"] == "read-only"
        assert [r["name"] for r in snap["racks"]] == list(h.RACKS)
        assert snap["racks"][0]["s"] == "h" * h.T and snap["racks"][0]["caps"] == {}
        assert [j["name"] for j in snap["jobs"]] == [h.JOB] and snap["jobs"][0]["generation"] == 1
        assert [e["seq"] for e in snap["events"]] == [1, 2, 3]
        node = h.node_name("rack-b", 1)
        h.put_health(api.store, node, {2: (types_pb2.GPU_FAILED, "xid 79")})
        racks = wait_until(lambda: [d for n, d in got if n == "racks"], 10, "a racks message")[0]
        assert [r["name"] for r in racks["racks"]] == ["rack-b"]  # only the rack that changed
        assert racks["racks"][0]["s"][h.GPUS_PER_NODE + 2] == "f"
        assert racks["racks"][0]["s"].count("f") == 1
        ev = types_pb2.Event(seq=4, at=h.NOW + 4, kind="plan", job=h.JOB, generation=2, cause="new")
        api.etcd.put(keys.event(4), codec.encode(ev))
        events = wait_until(lambda: [d for n, d in got if n == "events"], 10, "an events message")[0]
        assert [e["seq"] for e in events] == [4]  # the three it had are not sent again
    finally:
        stop.set()
        api.etcd.put(keys.LEADER, api.etcd.get(keys.LEADER).value)  # one more message ends the reader
        reader.join(10)


def test_streams_beyond_the_bound_are_refused_busy(api, monkeypatch):
    monkeypatch.setattr(routes, "MAX_STREAMS", 0)
    r = api.http.get("/v1/console/stream", headers=h.reader())
    assert r.status_code == 503 and r.json()["error"]["code"] == "busy"


def test_console_view_follows_plan_caps_to_the_racks_they_touch(api, console):
    _, cache = console
    view = live.ConsoleView(cache, None, "admin")
    first = view.snapshot()
    assert all(r["caps"] == {} for r in first["racks"])
    plan = types_pb2.Plan()
    plan.CopyFrom(api.plan)
    plan.generation = 2
    node = h.node_name("rack-a", 0)
    plan.power_caps.add(gpu=types_pb2.GpuRef(node=node, index=1), cap_w=1250.0)
    rev = api.etcd.put(keys.job_plan(h.JOB), codec.encode(plan))
    assert cache.wait_revision(rev, 10)
    out = dict(view.apply([Change(Kind.PLAN, h.JOB, rev)]))
    assert [r["name"] for r in out["racks"]["racks"]] == ["rack-a"]
    assert out["racks"]["racks"][0]["caps"] == {"1": 1250.0}
    assert out["jobs"][0]["generation"] == 2 and out["revision"] == rev
    assert view.apply([Change(Kind.POWER, "x", rev)]) == []  # nothing the console shows


def test_dry_run_previews_pins_with_a_plan_diff_and_writes_nothing(api):
    rev = api.etcd.status().header.revision
    r = api.http.post(f"/v1/jobs/{h.JOB}/dry-run", json={"pins": [{"replica": 1, "tp_degree": 6}]})
    assert r.status_code == 200, r.text
    changes = r.json()["changes"]
    assert {"kind": "replica", "field": "tp_degree", "before": 8, "after": 6, "replica": 1, "gpu": None} in changes
    gpus = next(c for c in changes if c["field"] == "gpus")
    assert len(gpus["before"]) == 8 and len(gpus["after"]) == 6 and set(gpus["after"]) < set(gpus["before"])
    assert api.etcd.status().header.revision == rev  # a preview commits nothing
    bad = api.http.post(f"/v1/jobs/{h.JOB}/dry-run", json={"pins": [{"replica": 1, "tp_degree": 9}]})
    assert bad.status_code == 422 and "base TP degree 8" in bad.json()["error"]["message"]
    same = api.http.post(f"/v1/jobs/{h.JOB}/dry-run", json={})
    assert same.json()["changes"] == []  # the current state plans the current plan


def test_console_view_follows_racks_that_appear_change_and_go(api, console):
    _, cache = console
    view = live.ConsoleView(cache, None, "read-only")
    view.snapshot()
    rack = types_pb2.Rack(name="rack-c", domain_size=4, gpu_tdp_w=1000.0, nodes=["rack-c-n0"], gpus_per_node=4)
    rev = api.store.put_rack(rack)
    assert cache.wait_revision(rev, 10)
    out = dict(view.apply([Change(Kind.RACK, "rack-c", rev)]))
    assert [r["name"] for r in out["racks"]["racks"]] == ["rack-c"] and out["racks"]["removed"] == []
    assert out["racks"]["racks"][0]["s"] == "ffff"  # listed, never registered: failed
    h.register(api.store, "rack-c", "rack-c-n0")  # its node's registration now moves its GPUs
    rev = api.etcd.status().header.revision
    assert cache.wait_revision(rev, 10)
    out = dict(view.apply([Change(Kind.NODE, "rack-c-n0", rev)]))
    assert out["racks"]["racks"][0]["s"] == "hhhh"
    rev = api.etcd.delete(keys.rack("rack-c")) and api.etcd.status().header.revision
    assert cache.wait_revision(rev, 10)
    out = dict(view.apply([Change(Kind.RACK, "rack-c", rev, deleted=True)]))
    assert out["racks"] == {"racks": [], "removed": ["rack-c"]}


def test_a_stream_whose_client_stops_reading_gives_its_slot_back(api, monkeypatch):
    """Clients that open the stream and never read: once the server's socket buffers are
    full, their sends wait; after routes.SEND_TIMEOUT_S the stream ends and its slot is
    free again (the slots were held for ever: MAX_STREAMS such clients locked everyone out
    with 503 busy)."""
    monkeypatch.setattr(routes, "MAX_STREAMS", 2)
    monkeypatch.setattr(routes, "SEND_TIMEOUT_S", 1.0)
    host, port = api.url.removeprefix("http://").split(":")
    stalled = []
    for _ in range(2):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast; never read
        s.sendall(f"GET /v1/console/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {h.READER}\r\n\r\n".encode())
        stalled.append(s)
        assert s.recv(12) == b"HTTP/1.1 200"  # its slot is taken; nothing more is read
    try:
        def status() -> int:  # the headers only: a stream that gets a slot never ends
            with api.http.stream("GET", "/v1/console/stream", headers=h.reader()) as r:
                return r.status_code

        wait_until(lambda: status() == 503, 10, "both slots taken")
        seq = [100]

        def churn_until_free() -> bool:
            # events the streams must carry, 256 KB each (loopback socket buffers hold MBs);
            # 48 at most (12 MB), well within etcd's space
            for _ in range(8 if seq[0] < 148 else 0):
                seq[0] += 1
                ev = types_pb2.Event(seq=seq[0], at=h.NOW, kind="plan", job=h.JOB, cause="x" * 262_144)
                api.etcd.put(keys.event(seq[0]), codec.encode(ev))
            return status() == 200
        wait_until(churn_until_free, 30, "a slot given back by a stalled stream")
    finally:
        for s in stalled:
            s.close()
