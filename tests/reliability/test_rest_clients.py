"""The load benchmark's REST generator (bench/rest_clients.py) against a real uvicorn
server: the open loop sends exactly its schedule, the closed loop its request count."""

from __future__ import annotations

import argparse
import time

import pytest
from fastapi import FastAPI

from bench.rest_clients import main, run
from tests.controller.api_harness import ServedApp


def _args(url: str, **kw) -> argparse.Namespace:
    base = dict(url=url, paths="/a,/b,/missing", mode="open", clients=4, rate=20.0, seconds=0.5,
                requests=3, processes=2, raw=False, on_off=None)
    return argparse.Namespace(**{**base, **kw})


def test_open_loop_sends_its_schedule_and_closed_loop_its_count():
    app = FastAPI()
    seen: list[str] = []

    @app.get("/a")
    async def a() -> dict:
        seen.append("a")
        return {}

    @app.get("/b")
    async def b() -> dict:
        seen.append("b")
        return {}

    server = ServedApp(app).start()
    try:
        out = run(_args(server.url))
        # each client: due at offset + k / 20 s for k while < 0.5 s -> 10 requests each
        assert out["requests"] == 40 and out["offered_rps"] == 80.0 and out["rate_per_client"] == 20.0
        missing = sum((i + k) % 3 == 2 for i in range(4) for k in range(10))  # clients take turns
        assert out["errors"] == {"404": missing} and len(seen) == 40 - missing
        assert 0 < out["p50_ms"] <= out["p99_ms"] <= out["max_ms"] and out["lag_p99_ms"] >= 0
        closed = run(_args(server.url, mode="closed"))
        assert closed["requests"] == 12 and closed["offered_rps"] is None and closed["achieved_rps"] > 0
    finally:
        server.stop()


def test_on_off_sends_only_the_requests_due_in_its_on_windows_and_lists_them():
    app = FastAPI()
    seen: list[float] = []

    @app.get("/a")
    async def a() -> dict:
        seen.append(time.monotonic())
        return {}

    server = ServedApp(app).start()
    try:
        # 4 clients at 16/s: request k of client i due at i/64 + k/16 s; cycles of 0.51 s,
        # the first 0.21 s of each ON (no due time lies within 1 ms of a window's edge)
        out = run(_args(server.url, paths="/a", rate=16.0, seconds=1.0, on_off="0.21,0.3"))
        due = [i / 64 + k / 16 for i in range(4) for k in range(16) if i / 64 + k / 16 < 1.0]
        on = [d for d in due if d % 0.51 < 0.21]
        assert 0 < len(on) < len(due) and out["requests"] == len(on) == len(seen)
        assert out["errors"] == {} and out["on_s"] == 0.42
        (a0, b0), (a1, b1) = out["windows"]
        assert abs(b0 - a0 - 0.21) < 1e-3 and abs(a1 - a0 - 0.51) < 1e-3 and abs(b1 - a1 - 0.21) < 1e-3
        # none reached the server in the OFF stretch (past the first ON window's requests on
        # their way: 0.2 s of slack for a loaded machine)
        assert all(a0 <= t for t in seen)
        assert not [t for t in seen if b0 + 0.2 < t < a1], "a request was sent in the OFF stretch"
    finally:
        server.stop()


@pytest.mark.parametrize("spec", ["1", "1,2,3", "0,5", "a,b", "nan,1"])
def test_a_bad_on_off_is_refused_with_exit_2(spec, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9", "--paths", "/a", "--on-off", spec])
    assert exc.value.code == 2 and "--on-off" in capsys.readouterr().err
