"""The floor under ``bench/controller_scale.py``'s failure->commit on this machine: the
same path with no decision in it.

A stand-in controller process (the project's etcd client, as the controller uses it)
watches its whole prefix, as the controller's informer does (so etcd also sends it its own
commits; ``--no-watch-own``: ``health/`` only), and, on each health event, commits a
prebuilt transaction shaped like one failure's commit at 262,144 GPUs (``--compares`` mod-revision compares, ``--ops`` puts of
``--bytes`` in all, the plan header last); no planning, encoding or view. This process
writes each failure's health record and times it to the plan's arrival at its own watch,
as ``controller_scale`` does. What is left between the two benches' failure->commit is
the controller's own work and its contention for the CPUs with etcd and the bench.

Prints one JSON line:
- ``floor_failure_to_commit_p50_ms`` / ``_p99_ms``: from just before the health put to the
  stand-in's commit arriving at this process's watch;
- ``etcd_put_p50_ms``: a bare put round trip of a health-sized value (200 in a row, before
  and after the failures, as ``controller_scale`` measures it);
- ``floor_vs_etcd_put_ratio``: floor failure->commit p50 over the bare put p50 (the same
  ratio as ``controller_scale``'s ``commit_vs_etcd_put_ratio``);
- ``watch_delivery_p50_ms`` (health put start to the stand-in's callback) and
  ``txn_p50_ms`` (the stand-in's transaction round trip), from the stand-in's clock
  (CLOCK_MONOTONIC, shared by both processes).

``--quick``: 5 failures (the same keys, seconds; for the test suite).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from tpflex_controller import synthetic
from tpflex_proto import codec
from tpflex_proto.etcd import Cmp, Etcd, Op

from bench.controller_scale import _put_p50_ms  # the same bare-put probe


def _standin(endpoint: str, ops: int, size: int, compares: int, watch_own: bool = False) -> int:
    etcd = Etcd([endpoint], timeout=10.0)
    fenced = [f"/floor/power/{i}" for i in range(compares)]
    for key in fenced:
        etcd.put(key, b"v" * 100)
    revs = {key: etcd.get(key).mod_revision for key in fenced}
    values = [os.urandom(max(1, size // ops)) for _ in range(ops)]
    stamps: list[tuple[float, float]] = []
    count = [0]

    def on_events(events) -> None:
        for ev in events:
            if watch_own and not ev.key.startswith("/floor/health/"):
                continue
            seen = time.perf_counter()
            count[0] += 1
            cmps = [Cmp.mod_revision(k, "==", r) for k, r in revs.items()]
            puts = [Op.put(f"/floor/x/{i}", values[i]) for i in range(ops - 1)]
            etcd.txn(cmps, [*puts, Op.put("/floor/plan", str(count[0]).encode())])
            stamps.append((seen, time.perf_counter()))

    watch = etcd.watch_prefix("/floor/" if watch_own else "/floor/health/", on_events)
    if not watch.established.wait(10):
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # the bench closes it when done
    watch.cancel()
    print(json.dumps(stamps), flush=True)
    etcd.close()
    return 0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--standin", metavar="ENDPOINT", help=argparse.SUPPRESS)
    ap.add_argument("--failures", type=int, default=120)
    ap.add_argument("--ops", type=int, default=24, help="puts in the commit (default: one failure's, 24)")
    ap.add_argument("--bytes", type=int, default=6_500, help="bytes put by the commit (default 6,500)")
    ap.add_argument("--compares", type=int, default=20, help="mod-revision compares (default 20)")
    ap.add_argument("--watch-own", action=argparse.BooleanOptionalAction, default=True,
                    help="the stand-in watches its own commits too (/floor/, as the controller's"
                    " informer watches /tpflex/v1/; default) or only the health writes")
    ap.add_argument("--quick", action="store_true", help="5 failures (the same JSON keys)")
    args = ap.parse_args(argv)
    if args.quick:
        args.failures = 5
    if min(args.failures, args.ops, args.bytes, args.compares) < 1:
        ap.error("--failures, --ops, --bytes and --compares must be at least 1")
    if args.standin:
        return _standin(args.standin, args.ops, args.bytes, args.compares, args.watch_own)
    from tests.support.etcd_server import EtcdCluster

    with EtcdCluster(1) as cluster:
        etcd = Etcd(cluster.endpoints, timeout=10.0)
        standin = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--standin", cluster.endpoints[0],
             "--ops", str(args.ops), "--bytes", str(args.bytes), "--compares", str(args.compares),
             "--watch-own" if args.watch_own else "--no-watch-own"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        cv = threading.Condition()
        arrived: dict[int, float] = {}

        def on_plan(events) -> None:
            now = time.perf_counter()
            with cv:
                for ev in events:
                    arrived[int(ev.value)] = now
                cv.notify_all()

        watch = etcd.watch_prefix("/floor/plan", on_plan)
        try:
            if standin.stdout.readline().strip() != "ready" or not watch.established.wait(10):
                raise RuntimeError("the stand-in controller did not start")
            put_before = _put_p50_ms(etcd)
            value = codec.encode(synthetic.failed_health("n", 4, {1}))
            started, samples = [], []
            for i in range(1, args.failures + 1):
                t0 = time.perf_counter()
                etcd.put(f"/floor/health/n{i}", value)
                with cv:
                    if not cv.wait_for(lambda i=i: i in arrived, 30):
                        raise TimeoutError(f"commit {i} not seen")
                started.append(t0)
                samples.append((arrived[i] - t0) * 1000)
            put_p50 = statistics.median([put_before, _put_p50_ms(etcd)])
        finally:
            watch.cancel()
            standin.stdin.close()
            out = standin.stdout.read()
            standin.wait(30)
            etcd.close()
    stamps = json.loads(out.strip().splitlines()[-1])
    p50 = statistics.median(samples)
    print(json.dumps({
        "floor_failure_to_commit_p50_ms": round(p50, 2),
        "floor_failure_to_commit_p99_ms": round(_pct(samples, 0.99), 2),
        "etcd_put_p50_ms": round(put_p50, 3),
        "floor_vs_etcd_put_ratio": round(p50 / put_p50, 1),
        "watch_delivery_p50_ms": round(statistics.median((s - t) * 1000 for (s, _), t in zip(stamps, started, strict=True)), 2),
        "txn_p50_ms": round(statistics.median((b - a) * 1000 for a, b in stamps), 2),
        "failures": len(samples),
        "ops": args.ops,
        "bytes": args.bytes,
        "compares": args.compares,
        "watch_own": args.watch_own,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
