"""The REST process's stall log (api/stalls.py, ``TPFLEX_DEBUG_REST_STALLS``): off without
the variable; with it, slow requests, slow folds and slow collections are written as JSON
lines, and quick ones are not."""

from __future__ import annotations

import asyncio
import gc
import json
import time

from tpflex_controller.api import stalls
from tpflex_proto.informer import Batch


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(stalls.ENV, raising=False)
    assert stalls.from_env() is None


def test_slow_requests_and_folds_are_logged_quick_ones_not(tmp_path, monkeypatch):
    path = tmp_path / "stalls.jsonl"
    monkeypatch.setenv(stalls.ENV, str(path))
    log = stalls.from_env()
    try:
        async def app(scope, receive, send):
            if scope["path"] == "/slow":
                time.sleep(0.06)  # the app holding the loop: what the log is for

        async def serve():
            wrapped = stalls.SlowRequests(app, log=log)
            for p in ("/quick", "/slow"):
                await wrapped({"type": "http", "path": p, "query_string": b"a=1"}, None, None)

        asyncio.run(serve())
        folded = []
        timed = stalls.timed_handler(log, lambda b: (folded.append(b), time.sleep(0.01)))
        timed(Batch((), 7))
        stalls.timed_handler(log, folded.append)(Batch((), 8))
        log._on_gc("start", {"generation": 2})
        time.sleep(0.006)
        log._on_gc("stop", {"generation": 2, "collected": 3})
        lines = [d for d in _lines(path) if d["kind"] in ("slow", "fold")]  # not the loop's
        assert [(d["kind"], d.get("path")) for d in lines] == [("slow", "/slow?a=1"), ("fold", None)]
        assert lines[0]["ms"] >= 60 and lines[1]["changes"] == 0 and lines[1]["ms"] >= 10
        # (the test process's own collections of >= 5 ms may be logged too)
        assert any(d["kind"] == "gc" and d["collected"] == 3 and d["ms"] >= 6 for d in _lines(path))
        assert [b.revision for b in folded] == [7, 8]
    finally:
        log.stop()
    assert log._on_gc not in gc.callbacks


def test_the_view_folds_through_the_wrapper_given_to_start(etcd):
    """``ApiStateCache.start(wrap=)``: the handler the informer calls is the wrapped one
    (how the REST process times folds), and the view still folds what it is given."""
    from tpflex_controller.api.cache import ApiStateCache
    from tpflex_proto import codec, keys, types_pb2

    seen = []

    def wrap(handler):
        def run(batch):
            seen.append(batch.revision)
            handler(batch)
        return run

    cache = ApiStateCache(etcd, retry_s=0.05).start(wrap=wrap)
    try:
        rev = etcd.put(keys.rack("r9"), codec.encode(types_pb2.Rack(name="r9", gpus_per_node=4)))
        assert cache.wait_revision(rev, 10)
        assert "r9" in cache.cluster().racks
        assert seen and seen[-1] >= rev  # the last batch folded went through the wrapper
    finally:
        cache.stop()
