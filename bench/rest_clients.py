"""REST load generator for ``bench/load.py``, run in its own process(es) so that the
clients do not share a process (an event loop, a GIL) with the bench's fleet or with what
they measure.

Two modes, one JSON line on stdout each:

- ``open`` (the realistic load): ``--clients`` users, each polling at ``--rate`` requests
  a second over its own keep-alive HTTP/1.1 connection(s) (plain asyncio streams: a
  fraction of httpx's CPU per request) on a fixed schedule (a dashboard or ``tpflexctl`` user: request k of client i
  is due at ``start + offset_i + k / rate``, offsets spread over one period). A request is
  sent when due, whether or not the client's previous one has returned (open loop), so
  latency includes the server's queueing; it is timed from the moment it was sent, and the
  generator's own lateness (sent - due) is reported apart as ``lag_p99_ms``: when that is
  not small, the generator, not the server, was the bottleneck. With ``--on-off ON,OFF``
  the schedule is cut into cycles of ON seconds of load then OFF seconds of none (the
  requests due in an OFF stretch are not sent), so that a caller can compare what it
  measures with and without the load in interleaved windows of one run; ``windows``
  lists the ON stretches as [start, end] on ``time.monotonic()`` (CLOCK_MONOTONIC, the
  same in every process of the machine) and ``achieved_rps`` is over their sum.
- ``closed`` (saturation): every client issues ``--requests`` GETs back to back with no
  think time; ``rps`` is then the server's throughput under saturation (latency there is
  queueing by construction: clients / throughput).

Keys: ``mode``, ``clients``, ``rate_per_client``, ``offered_rps``, ``achieved_rps``,
``requests``, ``errors``, ``p50_ms``, ``p99_ms``, ``max_ms``, ``lag_p99_ms``,
``duration_s``, ``cpu_s`` (the generator's own CPU time, its workers' included), ``on_s`` and
``windows`` (open), ``latencies_ms`` (with ``--raw``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import sys
import time

import httpx


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return -1.0
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


class _Conn:
    """One keep-alive HTTP/1.1 connection (asyncio streams: a fraction of httpx's CPU per
    request, so the generator stays light next to the server it measures)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        return cls(*await asyncio.open_connection(host, port))

    async def get(self, host: str, path: str) -> int:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.close()
            raise ConnectionError("server closed the connection")
        return status

    def close(self) -> None:
        self.writer.close()


def on_windows(start: float, seconds: float, on_off: tuple[float, float] | None) -> list[tuple[float, float]]:
    """The stretches of ``[start, start + seconds)`` in which the open loop sends: all of it,
    or each cycle's first ON seconds."""
    if on_off is None:
        return [(start, start + seconds)]
    on, off = on_off
    out, t = [], start
    while t < start + seconds:
        out.append((t, min(t + on, start + seconds)))
        t += on + off
    return out


async def _open(url: str, paths: list[str], first: int, clients: int, total: int, rate: float,
                seconds: float, start: float, on_off: tuple[float, float] | None = None
                ) -> tuple[list[float], list[float], dict]:
    lat: list[float] = []
    lag: list[float] = []
    errors: dict[str, int] = {}
    period = 1.0 / rate
    target = url.split("://", 1)[1].rstrip("/")
    host, _, port = target.partition(":")

    async def one(idle: list[_Conn], path: str, due: float) -> None:
        sent = time.monotonic()
        lag.append((sent - due) * 1000)
        conn = None
        try:
            # the client's idle connection, or a new one while the previous is still busy
            if idle:
                conn = idle.pop()
                try:
                    status = await asyncio.wait_for(conn.get(target, path), 30.0)
                except (OSError, asyncio.IncompleteReadError):
                    # the server closed it while idle (keep-alive timeout): as an HTTP
                    # client does, send the request again on a new connection
                    conn.close()
                    conn = None
            if conn is None:
                conn = await _Conn.open(host, int(port))
                status = await asyncio.wait_for(conn.get(target, path), 30.0)
            idle.append(conn)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            status = type(exc).__name__
            if conn is not None:
                conn.close()
        lat.append((time.monotonic() - sent) * 1000)
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + 1

    async def client(i: int) -> None:
        offset = period * i / total  # clients spread evenly over one period
        idle: list[_Conn] = []
        pending = []
        k = 0
        while (due := start + offset + k * period) < start + seconds:
            if on_off is not None and (due - start) % (on_off[0] + on_off[1]) >= on_off[0]:
                k += 1  # due in an OFF stretch: not sent
                continue
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            pending.append(asyncio.ensure_future(one(idle, paths[(i + k) % len(paths)], due)))
            k += 1
        await asyncio.gather(*pending)
        for conn in idle:
            conn.close()

    await asyncio.gather(*(client(first + i) for i in range(clients)))
    return lat, lag, errors


async def _closed(url: str, paths: list[str], first: int, clients: int, per_client: int
                  ) -> tuple[list[float], list[float], dict]:
    lat: list[float] = []
    errors: dict[str, int] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=30.0, limits=limits) as http:
        async def client(i: int) -> None:
            for k in range(per_client):
                t = time.monotonic()
                try:
                    status = (await http.get(paths[(i + k) % len(paths)])).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                lat.append((time.monotonic() - t) * 1000)
                if status != 200:
                    errors[str(status)] = errors.get(str(status), 0) + 1

        await asyncio.gather(*(client(first + i) for i in range(clients)))
    return lat, [], errors


def _worker(args: argparse.Namespace, paths: list[str], first: int, count: int, start: float, out) -> None:
    if args.mode == "open":
        res = asyncio.run(_open(args.url, paths, first, count, args.clients, args.rate, args.seconds, start,
                                _on_off(args)))
    else:
        res = asyncio.run(_closed(args.url, paths, first, count, args.requests))
    out.put(res)


def parse_on_off(spec: str) -> tuple[float, float]:
    """``"ON,OFF"`` as seconds (0 < ON <= 3600, 0 <= OFF <= 3600); ValueError with a
    message otherwise."""
    try:
        on, off = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"want two numbers of seconds, ON,OFF (got {spec!r})") from None
    if not (0 < on <= 3600 and 0 <= off <= 3600):
        raise ValueError(f"need 0 < ON <= 3600 and 0 <= OFF <= 3600 (got {spec!r})")
    return on, off


def _on_off(args: argparse.Namespace) -> tuple[float, float] | None:
    spec = getattr(args, "on_off", None)
    return parse_on_off(spec) if spec else None


def run(args: argparse.Namespace) -> dict:
    paths = [p for p in args.paths.split(",") if p]
    procs = max(1, min(args.processes, args.clients))
    start = time.monotonic() + 1.0  # every worker started and connected-ready by then
    queue: multiprocessing.Queue = multiprocessing.Queue()
    workers = []
    share, extra = divmod(args.clients, procs)
    first = 0
    for w in range(procs):
        count = share + (w < extra)
        p = multiprocessing.Process(target=_worker, args=(args, paths, first, count, start, queue), daemon=True)
        p.start()
        workers.append(p)
        first += count
    lat: list[float] = []
    lag: list[float] = []
    errors: dict[str, int] = {}
    t0 = time.monotonic()
    for _ in workers:
        a, b, e = queue.get()
        lat += a
        lag += b
        for k, v in e.items():
            errors[k] = errors.get(k, 0) + v
    for p in workers:
        p.join()
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    duration = time.monotonic() - (start if args.mode == "open" else t0)
    windows = on_windows(start, args.seconds, _on_off(args)) if args.mode == "open" else []
    on_s = sum(b - a for a, b in windows)
    busy = min(on_s, duration) if args.mode == "open" and _on_off(args) is not None else duration
    out = {
        "mode": args.mode, "clients": args.clients, "processes": procs,
        "rate_per_client": args.rate if args.mode == "open" else None,
        "offered_rps": round(args.clients * args.rate, 1) if args.mode == "open" else None,
        "achieved_rps": round(len(lat) / busy, 1) if busy > 0 else -1.0,
        "requests": len(lat), "errors": errors, "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
        "max_ms": round(max(lat), 2) if lat else -1.0, "lag_p99_ms": _pct(lag, 0.99),
        "duration_s": round(duration, 1), "cpu_s": round(cpu, 1),
    }
    if args.mode == "open":
        out["on_s"] = round(on_s, 3)
        out["windows"] = [[round(a, 3), round(b, 3)] for a, b in windows]
    if args.raw:
        out["latencies_ms"] = [round(x, 2) for x in lat]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--paths", required=True, help="comma-separated paths, clients take turns")
    p.add_argument("--mode", choices=("open", "closed"), default="open")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--rate", type=float, default=0.5, help="open: requests a second per client")
    p.add_argument("--seconds", type=float, default=30.0, help="open: how long")
    p.add_argument("--requests", type=int, default=5, help="closed: GETs per client")
    p.add_argument("--on-off", metavar="ON,OFF",
                   help="open: cycles of ON seconds of load and OFF seconds of none (default: load throughout)")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--raw", action="store_true", help="add every latency")
    args = p.parse_args(argv)
    if args.on_off is not None:
        try:
            parse_on_off(args.on_off)
        except ValueError as exc:
            p.error(f"--on-off: {exc}")
    if not (1 <= args.clients <= 10_000 and 0 < args.rate <= 100 and 0 < args.seconds <= 3600
            and 1 <= args.requests <= 10_000 and 1 <= args.processes <= 16):
        p.error("need 1 <= clients <= 10000, 0 < rate <= 100, 0 < seconds <= 3600, "
                "1 <= requests <= 10000, 1 <= processes <= 16")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
