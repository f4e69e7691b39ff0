"""Keep the load benchmark's node leases alive from a process of their own.

The real nodes are separate processes, each renewing its own lease; the benchmark's nodes
must not share a GIL with the offline checks and the plan watcher (issue 14: in 10-minute
runs the bench's checks held the GIL for minutes and thousands of leases lapsed).

``LeaseKeeper`` (the parent's handle) starts ``python -m bench.lease_keeper``, hands it
the leases on stdin as one JSON line, and on ``stop()`` reads back one JSON line of
figures. The child renews over ``streams`` LeaseKeepAlive streams, each lease when its
last renewal is ``period_s`` old (oldest first, never a lease already in flight), with at
most ``window`` requests in flight per stream.

``RenewalSchedule`` is the pure part: which lease is due, and the worst gap between two
renewals of a lease (``lease_renew_lag_max_s``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path


class RenewalSchedule:
    """Leases in the order their renewals fall due; no I/O, the clock is an argument.

    A lease is either waiting (in ``_due``, oldest renewal first) or in flight; an ack puts
    it back at the end (due ``period_s`` after the ack), an expiry drops it for good."""

    def __init__(self, granted: dict[int, float], period_s: float) -> None:
        self.period_s = period_s
        self.last_ack = dict(granted)  # lease -> time of the grant or the last ack
        order = sorted(granted, key=granted.get)
        self._due: deque[tuple[float, int]] = deque((granted[lease] + period_s, lease) for lease in order)
        self.in_flight: set[int] = set()
        self.expired: set[int] = set()
        self.acks = 0
        self.expiries = 0
        self.lag_max_s = 0.0

    def next_due(self, now: float) -> int | None:
        """The lease to renew now (moved to in flight), or None if none is due yet."""
        if not self._due or self._due[0][0] > now:
            return None
        _, lease = self._due.popleft()
        self.in_flight.add(lease)
        return lease

    def wait_s(self, now: float) -> float | None:
        """Seconds until the next lease falls due (None: nothing is waiting)."""
        return max(0.0, self._due[0][0] - now) if self._due else None

    def answered(self, lease: int, ttl: int, now: float) -> None:
        """etcd's answer for ``lease``: ``ttl`` > 0 renewed, 0 the lease is gone."""
        if lease not in self.in_flight:
            return  # an answer to a request re-sent after a stream broke
        self.in_flight.discard(lease)
        if ttl <= 0:
            self.expiries += 1
            self.expired.add(lease)
            return
        self.acks += 1
        self.lag_max_s = max(self.lag_max_s, now - self.last_ack[lease])
        self.last_ack[lease] = now
        self._due.append((now + self.period_s, lease))

    def requeue(self, leases) -> None:
        """Requests lost with a broken stream: due again at once, ahead of the others."""
        for lease in leases:
            if lease in self.in_flight:
                self.in_flight.discard(lease)
                self._due.appendleft((0.0, lease))

    def worst_lag_s(self, now: float) -> float:
        """The worst gap so far, counting the open one of each live lease up to ``now``."""
        live = [now - t for lease, t in self.last_ack.items() if lease not in self.expired]
        return max([self.lag_max_s, *live])


# ---- the child process ----


def _stream(etcd, schedule: RenewalSchedule, cond: threading.Condition, stop: threading.Event,
            window: int, errors: list[int]) -> None:
    import grpc
    from tpflex_proto.etcd import etcdrpc

    def requests(alive: list[bool]):
        while True:
            with cond:
                while alive[0] and not stop.is_set():
                    now = time.monotonic()
                    if len(schedule.in_flight) < window:
                        lease = schedule.next_due(now)
                        if lease is not None:
                            break
                        cond.wait(schedule.wait_s(now))
                    else:
                        cond.wait()
                else:
                    return
            yield etcdrpc.LeaseKeepAliveRequest(ID=lease)

    while not stop.is_set():
        alive = [True]  # False once this call broke: its generator must take no more leases
        call = etcd._lease.LeaseKeepAlive(requests(alive))
        try:
            for resp in call:
                with cond:
                    schedule.answered(resp.ID, resp.TTL, time.monotonic())
                    cond.notify_all()
        except (grpc.RpcError, ValueError) as exc:  # broke, or the channel closed as we stop
            if not stop.is_set():
                print(f"lease keepalive stream broke error={exc!r:.200}", file=sys.stderr, flush=True)
        if stop.is_set():
            return
        errors[0] += 1
        with cond:
            alive[0] = False
            schedule.requeue(list(schedule.in_flight))
            cond.notify_all()
        stop.wait(0.5)


def _child() -> int:
    from tpflex_proto.etcd import Etcd

    spec = json.loads(sys.stdin.readline())
    offset = time.monotonic() - time.time()  # the parent's grant times are wall-clock
    leases = [(int(lease), t + offset) for lease, t in spec["leases"]]
    etcd = Etcd(spec["endpoints"], timeout=10.0)
    stop = threading.Event()
    parts = [(RenewalSchedule(dict(leases[i::spec["streams"]]), spec["period_s"]), threading.Condition())
             for i in range(spec["streams"])]
    errors = [0]
    threads = [threading.Thread(target=_stream, args=(etcd, s, c, stop, spec["window"], errors), daemon=True)
               for s, c in parts]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()  # "stop", or EOF when the parent died
    now = time.monotonic()
    with_locks = []
    for s, c in parts:
        with c:
            with_locks.append((s.acks, s.expiries, len(s.expired), s.worst_lag_s(now)))
    stop.set()
    for _, c in parts:
        with c:
            c.notify_all()
    print(json.dumps({
        "lease_keepalives": sum(x[0] for x in with_locks), "leases_expired": sum(x[2] for x in with_locks),
        "lease_expired_answers": sum(x[1] for x in with_locks),
        "lease_renew_lag_max_s": round(max((x[3] for x in with_locks), default=0.0), 2),
        "lease_stream_errors": errors[0], "lease_streams": spec["streams"],
    }), flush=True)
    etcd.close()
    return 0


# ---- the parent's handle ----


class LeaseKeeper:
    """Runs the child process; ``stop()`` returns its figures (a dict)."""

    def __init__(self, endpoints: list[str], granted: dict[int, float], ttl_s: int,
                 streams: int = 4, window: int = 64) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.lease_keeper"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
        spec = {"endpoints": list(endpoints), "period_s": ttl_s / 3, "streams": streams, "window": window,
                "leases": [[lease, t] for lease, t in granted.items()]}
        self._proc.stdin.write(json.dumps(spec) + "\n")
        self._proc.stdin.flush()
        if self._proc.stdout.readline().strip() != "ready":
            self._proc.kill()
            raise RuntimeError("lease keeper did not start")

    def stop(self) -> dict:
        if self._proc.poll() is not None:
            return {}
        try:
            out, _ = self._proc.communicate("stop\n", timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            return {}
        lines = out.strip().splitlines()
        return json.loads(lines[-1]) if lines else {}


if __name__ == "__main__":
    sys.exit(_child())
