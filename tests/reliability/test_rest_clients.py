"""The load benchmark's REST generator (bench/rest_clients.py) against a real uvicorn
server: the open loop sends exactly its schedule, the closed loop its request count."""

from __future__ import annotations

import argparse

from fastapi import FastAPI

from bench.rest_clients import run
from tests.controller.api_harness import ServedApp


def _args(url: str, **kw) -> argparse.Namespace:
    base = dict(url=url, paths="/a,/b,/missing", mode="open", clients=4, rate=20.0, seconds=0.5,
                requests=3, processes=2, raw=False)
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
