"""REST CPU per request: the REST child process's CPU time over N requests of the paths
``bench/load.py``'s clients poll, at 10,000 nodes with GPU failures+recoveries injected
meanwhile (``--rate`` a minute), on a real etcd against a real ``tpflex-controller``.

Requests are sent by one client, back to back, in rounds over every path (a dashboard's
mix); the REST child's user+system CPU seconds (``/proc/<pid>/stat``) over them, divided
by their number, is ``rest_cpu_ms_per_request``; ``rest_cpu_ms_per_request_by_path`` the
same per path kind measured in separate passes. Both include what the REST process spends
meanwhile folding the changes into its view, measured alone (no requests, same injection)
as ``rest_idle_cpu_ms_per_s``. Prints one JSON line.

``--quick``: 576 nodes (one job), 20 requests of the mix and 5 per path kind, 0.5 s idle (the same
keys, seconds; for the test suite, its figures are not the measurement's).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from tpflex_proto.etcd import Etcd

from bench.load import NodeFleet, PlanLog, _cpu_s, _rest_pid, _seed, _start_controller, _wait
from tests.support.etcd_server import EtcdCluster


def _kinds(paths: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in paths:
        kind = p.split("?")[0]
        if kind.startswith("/v1/jobs/"):
            kind = "/v1/jobs/{job}/plan" if kind.endswith("/plan") else "/v1/jobs/{job}"
        elif kind.startswith("/v1/nodes/"):
            kind = "/v1/nodes/{node}"
        out.setdefault(kind, []).append(p)
    return out


def _ready(http: httpx.Client) -> bool:
    """The REST process answers /readyz 200 (the controller may not listen yet)."""
    try:
        return http.get("/readyz").status_code == 200
    except httpx.TransportError:
        return False


def _run(args, workdir: Path) -> dict:
    cluster = EtcdCluster(1, workdir / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=10.0)
    ctl = None
    fleet = None
    stop = threading.Event()
    try:
        racks, jobs = _seed(etcd, args.nodes)
        fleet = NodeFleet(etcd, racks)
        fleet.register()
        fleet.start_keepalive(cluster.endpoints)
        log = PlanLog(etcd)
        ctl, url = _start_controller(cluster.endpoints, workdir)
        _wait(lambda: len(log.plans) == len(jobs), 120, "initial plans")
        _wait(lambda: _rest_pid(ctl.pid) is not None, 120, "the REST process")  # a small cluster plans first
        child = _rest_pid(ctl.pid)
        paths = [f"/v1/jobs/{j}/plan" for j in jobs] + [f"/v1/jobs/{j}" for j in jobs] + [
            "/v1/status", "/v1/gpus?state=failed&limit=100", "/v1/nodes?limit=100",
            "/v1/racks?limit=100", f"/v1/nodes/{next(iter(fleet.node_rack))}"]
        rng = random.Random(args.seed)

        def inject() -> None:
            interval = 60.0 / args.rate
            nxt = time.monotonic()
            while not stop.is_set():
                fleet.inject(rng)
                nxt += interval
                stop.wait(max(0.0, nxt - time.monotonic()))

        with httpx.Client(base_url=url, timeout=60) as http:
            _wait(lambda: _ready(http), 120, "REST view synced")
            for p in paths:  # the first render of each (warm-up), not measured
                http.get(p).raise_for_status()
            threading.Thread(target=inject, daemon=True).start()
            time.sleep(2.0)
            idle_cpu, t = _cpu_s(child), time.monotonic()
            time.sleep(args.idle_seconds)  # the view folding the changes, no requests
            idle = (_cpu_s(child) - idle_cpu) * 1000 / (time.monotonic() - t)

            def measure(ps: list[str], n: int) -> float:
                cpu, t = _cpu_s(child), time.monotonic()
                for i in range(n):
                    http.get(ps[i % len(ps)]).raise_for_status()
                return (_cpu_s(child) - cpu) * 1000 / n, (time.monotonic() - t) * 1000 / n

            mix_cpu, mix_wall = measure(paths, args.requests)
            by_path = {k: round(measure(ps, args.requests_per_kind)[0], 2) for k, ps in _kinds(paths).items()}
        return {"nodes": args.nodes, "events_per_minute": args.rate, "requests": args.requests,
                "rest_cpu_ms_per_request": round(mix_cpu, 2), "rest_wall_ms_per_request": round(mix_wall, 2),
                "rest_cpu_ms_per_request_by_path": by_path, "paths": len(paths),
                "rest_idle_cpu_ms_per_s": round(idle, 1)}
    finally:
        stop.set()
        if fleet is not None:
            fleet.stop()
        if ctl is not None:
            ctl.terminate()
            try:
                ctl.wait(15)
            except Exception:
                ctl.kill()
        etcd.close()
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=1000.0, help="GPU failures+recoveries per minute")
    p.add_argument("--requests", type=int, default=1000, help="requests of the mix")
    p.add_argument("--requests-per-kind", type=int, default=200)
    p.add_argument("--idle-seconds", type=float, default=5.0, help="CPU of the REST process without requests")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="576 nodes, 20 + 5 per kind requests (the same JSON keys)")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.rate, args.requests, args.requests_per_kind, args.idle_seconds = 576, 600.0, 20, 5, 0.5
    if not (1 <= args.nodes <= 20_000 and 0 < args.rate <= 10_000 and 1 <= args.requests <= 100_000
            and 1 <= args.requests_per_kind <= 10_000):
        p.error("need 1 <= nodes <= 20000, 0 < rate <= 10000, 1 <= requests <= 100000, "
                "1 <= requests-per-kind <= 10000")
    with tempfile.TemporaryDirectory(prefix="tpflex-restcpu-") as d:
        print(json.dumps(_run(args, Path(d))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
