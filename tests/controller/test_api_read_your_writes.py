"""Read-your-writes through the REST process's watch-fed view (``ApiDeps.settle``): a
mutating request answers only once the view holds its write, so the client's next GET
reads it; a view that stays behind delays the answer at most ``read_your_writes_s`` (the
write is in etcd either way, and the answer is still 202). Real etcd, the app under a
real uvicorn, the view's folds held back by a gate on its informer's handler."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
from tpflex_controller.api import create_app
from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.store import Store
from tpflex_proto import keys

from tests.controller import api_harness as h
from tests.controller.api_harness import ServedApp, make_deps, write_token_file
from tests.support.wait import wait_until


@pytest.fixture
def gated(etcd, tmp_path):
    """The view, its fold gate (set = folds pass), the served app and its deps."""
    h.seed(Store(etcd))
    gate = threading.Event()
    gate.set()

    def wrap(handler):
        def run(batch):
            gate.wait()  # the informer's thread: the view folds nothing while the gate is shut
            handler(batch)
        return run

    cache = ApiStateCache(etcd, retry_s=0.05).start(wrap=wrap)
    deps = make_deps(etcd, write_token_file(tmp_path))
    deps.state = cache
    server = ServedApp(create_app(deps)).start()
    try:
        assert cache.wait_revision(etcd.status().header.revision, 10)
        yield cache, gate, server, deps
    finally:
        gate.set()
        server.stop()
        cache.stop()


def _post_in_thread(url: str, path: str, body: dict | None) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def post():
        with httpx.Client(base_url=url, timeout=30) as http:
            answer["r"] = http.post(path, json=body, headers=h.admin())

    t = threading.Thread(target=post, daemon=True)
    t.start()
    return t, answer


def test_a_drain_answers_once_the_view_holds_it(etcd, gated):
    _, gate, server, _ = gated
    node = h.node_name(h.RACKS[0], 1)
    gpu = f"/v1/nodes/{node}/gpus/1"
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get(gpu).json()["drained"] is False
        gate.clear()
        t, answer = _post_in_thread(server.url, f"{gpu}/drain", {"reason": "ryw"})
        wait_until(lambda: etcd.get(keys.gpu_override(node, 1)) is not None, 10, "the drain in etcd")
        t.join(0.5)  # the write is in etcd, but the view cannot fold it: no answer yet
        assert t.is_alive() and not answer
        gate.set()
        t.join(10)
        assert answer["r"].status_code == 202, answer["r"].text
        assert answer["r"].json()["changed"] is True
        assert http.get(gpu).json()["drained"] is True  # at once, no polling
        # and the undrain likewise
        r = http.post(f"{gpu}/undrain", headers=h.admin())
        assert r.status_code == 202 and http.get(gpu).json()["drained"] is False


def test_a_job_override_answers_once_the_view_holds_it(etcd, gated):
    _, gate, server, _ = gated
    with httpx.Client(base_url=server.url, timeout=10) as http:
        gate.clear()
        t, answer = _post_in_thread(server.url, f"/v1/jobs/{h.JOB}/reconfigure", {"policy": "ntp"})
        wait_until(lambda: etcd.get(keys.job_override(h.JOB)) is not None, 10, "the override in etcd")
        t.join(0.5)
        assert t.is_alive() and not answer
        gate.set()
        t.join(10)
        assert answer["r"].status_code == 202, answer["r"].text
        assert http.get(f"/v1/jobs/{h.JOB}").json()["override"]["policy"] == "ntp"  # at once


def test_a_view_that_stays_behind_delays_the_answer_only_so_long(etcd, gated, caplog):
    cache, gate, server, deps = gated
    deps.read_your_writes_s = 0.3
    node = h.node_name(h.RACKS[1], 0)
    gpu = f"/v1/nodes/{node}/gpus/2"
    gate.clear()
    with caplog.at_level(logging.WARNING, logger="tpflex_controller.api.deps"), \
            httpx.Client(base_url=server.url, timeout=10) as http:
        r = http.post(f"{gpu}/drain", json={"reason": "behind"}, headers=h.admin())
        assert r.status_code == 202 and r.json()["changed"] is True  # the write is in etcd
        assert etcd.get(keys.gpu_override(node, 2)) is not None
        assert "did not reach a write's revision" in caplog.text
        gate.set()
        assert cache.wait_revision(etcd.status().header.revision, 10)
        assert http.get(gpu).json()["drained"] is True
