"""The REST API served from the watch-fed ApiStateCache: a real etcd, real uvicorn, real
HTTP. The cached app must answer exactly what the etcd-per-request app answers, follow
changes, answer 503 with a message while it has no current view, and bound the requests
it serves at once."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import httpx
from tpflex_controller.api import create_app
from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd, EtcdError, Op

from tests.controller import api_harness as h
from tests.controller.api_harness import ServedApp, make_deps, write_token_file
from tests.controller.controller_harness import eventually
from tests.support.etcd_server import EtcdCluster
from tests.support.rest import rest_error


def _error(resp, status: int) -> str:
    return rest_error(resp, status)["message"]


@contextmanager
def _cached_app(etcd: Etcd, tmp_path, **deps_kw):
    cache = ApiStateCache(etcd, retry_s=0.05).start()
    deps = make_deps(etcd, write_token_file(tmp_path))
    deps.state = cache
    for k, v in deps_kw.items():
        setattr(deps, k, v)
    server = ServedApp(create_app(deps)).start()
    http = httpx.Client(base_url=server.url, timeout=10.0)
    try:
        yield cache, http
    finally:
        http.close()
        server.stop()
        cache.stop()


def _caught_up(cache: ApiStateCache, etcd: Etcd) -> None:
    assert cache.wait_revision(etcd.status().header.revision, timeout=10)


def _put_when_back(etcd: Etcd, key: str, value: bytes) -> None:
    """A write once the restarted etcd accepts one (the client may still be backing off)."""
    def attempt() -> bool:
        try:
            etcd.put(key, value)
        except EtcdError:
            return False
        return True
    eventually(attempt, timeout=15, interval=0.1)


PATHS = [
    "/v1/racks", "/v1/racks/rack-a", "/v1/nodes", "/v1/nodes/rack-a-n1", "/v1/nodes/rack-b-n0",
    "/v1/gpus", "/v1/gpus?state=failed", "/v1/nodes/rack-a-n1/gpus/2", "/v1/jobs",
    f"/v1/jobs/{h.JOB}", f"/v1/jobs/{h.JOB}/plan", f"/v1/jobs/{h.JOB}/plans", "/v1/events?limit=2",
    "/v1/status", "/readyz", "/v1/nodes/ghost", "/v1/racks/ghost", "/v1/jobs/ghost",
]


def test_cached_reads_equal_etcd_reads_and_follow_changes(etcd, tmp_path):
    store = Store(etcd)
    h.seed(store, registered_missing="rack-b-n0")
    h.put_health(store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")})
    etcd.put(keys.gpu_override("rack-a-n0", 1), codec.encode(types_pb2.GpuOverride(
        gpu=types_pb2.GpuRef(node="rack-a-n0", index=1), drained=True, reason="maint")))
    direct = ServedApp(create_app(make_deps(etcd, write_token_file(tmp_path)))).start()
    try:
        with _cached_app(etcd, tmp_path) as (cache, http), httpx.Client(base_url=direct.url) as ref:
            _caught_up(cache, etcd)
            for path in PATHS:
                a, b = http.get(path), ref.get(path)
                assert (a.status_code, a.json()) == (b.status_code, b.json()), path
            assert http.get("/v1/nodes/rack-a-n1/gpus/2").json()["state"] == "failed"

            h.put_health(store, "rack-a-n1", {})  # recovered
            etcd.delete(keys.node("rack-a-n0"))  # its lease lapsed
            etcd.delete(keys.gpu_override("rack-a-n0", 1))
            h.register(store, "rack-b", "rack-b-n0")
            _caught_up(cache, etcd)
            assert http.get("/v1/nodes/rack-a-n1/gpus/2").json()["state"] == "healthy"
            assert http.get("/v1/nodes/rack-a-n0").json()["live"] is False
            assert http.get("/v1/nodes/rack-b-n0").json()["live"] is True
            for path in PATHS:
                a, b = http.get(path), ref.get(path)
                assert (a.status_code, a.json()) == (b.status_code, b.json()), path
    finally:
        direct.stop()


def test_single_object_reads_touch_only_that_object(etcd, tmp_path):
    store = Store(etcd)
    h.seed(store)
    cache = ApiStateCache(etcd).start()
    try:
        _caught_up(cache, etcd)
        snap, rack = cache.node_cluster("rack-b-n1")
        assert rack == "rack-b" and set(snap.nodes) == set(snap.health) == {"rack-b-n1"}
        assert set(snap.racks) == {"rack-b"}
        part = cache.rack_cluster("rack-a")
        assert set(part.racks) == {"rack-a"} and set(part.nodes) == {"rack-a-n0", "rack-a-n1"}
        assert cache.node_cluster("ghost") is None and cache.rack_cluster("ghost") is None
        assert [p.generation for p in cache.plan_history(h.JOB)] == [1]
        assert sorted(cache.acks(h.JOB)) == [0, 1]
    finally:
        cache.stop()


def test_reads_answer_503_until_synced_and_while_etcd_is_away(etcd_server, etcd, tmp_path):
    h.seed(Store(etcd))
    member = etcd_server.members[0]
    member.stop()
    with _cached_app(etcd, tmp_path) as (cache, http):
        assert "not loaded" in _error(http.get("/v1/nodes/rack-a-n0"), 503)
        assert "not ready" in _error(http.get("/readyz"), 503)
        etcd_server.restart_member(0)
        _put_when_back(etcd, keys.health("rack-a-n1"), codec.encode(types_pb2.NodeHealth(node="rack-a-n1")))
        _caught_up(cache, etcd)
        assert http.get("/v1/nodes/rack-a-n0").status_code == 200
        assert http.get("/readyz").json()["leader"] == "ctl-1"

        member.stop()
        eventually(lambda: not cache.ready)  # the watch notices etcd is gone
        assert "etcd unreachable" in _error(http.get(f"/v1/jobs/{h.JOB}"), 503)
        assert "etcd unreachable" in _error(http.get("/readyz"), 503)
        etcd_server.restart_member(0)
        _put_when_back(etcd, keys.health("rack-a-n0"), codec.encode(types_pb2.NodeHealth(node="rack-a-n0")))
        _caught_up(cache, etcd)
        assert http.get(f"/v1/jobs/{h.JOB}").status_code == 200


def test_requests_beyond_the_in_flight_bound_wait_then_get_busy(etcd, tmp_path):
    h.seed(Store(etcd))
    entered, release = threading.Event(), threading.Event()
    from tpflex_controller.planner import plan as real_plan

    def slow_planner(*args, **kw):
        entered.set()
        release.wait(30)
        return real_plan(*args, **kw)

    with _cached_app(etcd, tmp_path, max_in_flight=1, busy_wait_s=0.3, planner=slow_planner) as (cache, http):
        _caught_up(cache, etcd)
        done: dict = {}
        holder = threading.Thread(
            target=lambda: done.setdefault("r", http.post(f"/v1/jobs/{h.JOB}/dry-run", json={})))
        holder.start()
        assert entered.wait(10)
        busy = http.get("/v1/jobs")
        assert "busy" in _error(busy, 503) and busy.headers["retry-after"] == "1"
        assert http.get("/readyz").status_code == 200  # probes are never held back
        release.set()
        holder.join(10)
        assert done["r"].status_code == 200
        assert http.get("/v1/jobs").status_code == 200  # the slot is free again


def test_events_of_one_job_come_from_the_whole_log(etcd, tmp_path):
    """``/v1/events?job=`` searches the whole stored log (``event_log_size`` may be up to
    1,000,000), not only its latest 1,000 entries: a quiet job's events stay listed after
    1,500 events of a busy one. Cached and direct reads agree."""
    store = Store(etcd)
    h.seed(store)  # events 1-3 of h.JOB
    quiet = [types_pb2.Event(seq=s, at=h.NOW + s, kind="plan_committed", job="quiet", generation=s)
             for s in range(4, 9)]
    busy = [types_pb2.Event(seq=s, at=h.NOW + s, kind="plan_committed", job="busy", generation=s)
            for s in range(9, 1509)]
    events = quiet + busy
    for i in range(0, len(events), 100):
        etcd.txn([], [Op.put(keys.event(e.seq), codec.encode(e)) for e in events[i:i + 100]])
    direct = ServedApp(create_app(make_deps(etcd, write_token_file(tmp_path)))).start()
    try:
        with _cached_app(etcd, tmp_path) as (cache, http), httpx.Client(base_url=direct.url) as ref:
            _caught_up(cache, etcd)
            for client in (http, ref):
                def seqs(client=client, **params):
                    r = client.get("/v1/events", params=params)
                    assert r.status_code == 200, r.text
                    return [e["seq"] for e in r.json()["events"]]
                assert seqs(job="quiet", limit=100) == [4, 5, 6, 7, 8]
                assert seqs(job="quiet", limit=2) == [7, 8]
                assert seqs(job=h.JOB) == [1, 2, 3]
                assert seqs(job="busy", limit=3) == [1506, 1507, 1508]
                assert seqs(limit=2) == [1507, 1508]
                assert seqs(job="nobody") == []
    finally:
        direct.stop()


def test_readiness_and_reads_answer_503_while_etcd_has_no_quorum(tmp_path):
    """Two of three members stopped: the one left answers nothing that needs the raft
    leader and keeps its watch streams open and silent. The watch-fed view alone took
    that for a quiet cluster: /readyz said ready and reads answered from the stale view
    for the whole outage. Now the watches ask for a leader ("hasleader": etcd ends them)
    and readiness asks etcd itself."""
    cluster = EtcdCluster(3, tmp_path / "etcd").start()
    etcd = Etcd(cluster.endpoints[:1], timeout=2.0)  # the member that stays up
    try:
        h.seed(Store(etcd))
        with _cached_app(etcd, tmp_path) as (cache, http):
            _caught_up(cache, etcd)
            assert http.get("/readyz").json()["leader"] == "ctl-1"
            for i in (1, 2):
                cluster.members[i].stop()
            eventually(lambda: http.get("/readyz").status_code == 503, timeout=20, interval=0.2)
            _error(http.get("/readyz"), 503)
            eventually(lambda: http.get(f"/v1/jobs/{h.JOB}").status_code == 503, timeout=20, interval=0.2)
            for i in (1, 2):
                cluster.restart_member(i)
            eventually(lambda: http.get("/readyz").status_code == 200, timeout=30, interval=0.2)
            eventually(lambda: http.get(f"/v1/jobs/{h.JOB}").status_code == 200, timeout=30, interval=0.2)
    finally:
        etcd.close()
        cluster.stop()


def test_readiness_answers_503_while_etcd_is_frozen(tmp_path):
    """A member stopped with SIGSTOP keeps every connection open and answers nothing: the
    watch stays "established" and silent. Readiness asks etcd itself (a linearizable read
    with a 1 s deadline), so it answers 503 until etcd runs again."""
    cluster = EtcdCluster(1, tmp_path / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    member = cluster.members[0]
    try:
        h.seed(Store(etcd))
        with _cached_app(etcd, tmp_path) as (cache, http):
            _caught_up(cache, etcd)
            assert http.get("/readyz").status_code == 200
            member.proc.send_signal(signal.SIGSTOP)
            try:
                eventually(lambda: http.get("/readyz").status_code == 503, timeout=20, interval=0.2)
                assert "etcd does not answer" in _error(http.get("/readyz"), 503)
            finally:
                member.proc.send_signal(signal.SIGCONT)
            eventually(lambda: http.get("/readyz").status_code == 200, timeout=30, interval=0.2)
    finally:
        etcd.close()
        cluster.stop()
