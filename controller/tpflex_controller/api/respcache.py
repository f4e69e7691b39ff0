"""Rendered responses of the hot GET endpoints, reused while what they render is unchanged
(pure ASGI middleware in front of the routes).

A dashboard's 200 users poll the same few pages; the REST process used to render each
request anew (6.7 ms of CPU per request at 10,000 nodes: FastAPI's routing, dependencies
and response validation, and the render). :class:`ResponseCache` keeps each successful
(200) response's status, headers and body keyed by the request's path, query string and
Host header (a page's ``Link`` header names the URL asked for),
valid for one **version of the data it renders** (``ApiStateCache.version``): a job's
pages by that job's records, a node's page by that node's records, the list pages by any
node or rack, ``/v1/status`` by the etcd revision. A GPU failure therefore does not
re-render ``/v1/jobs/<job>`` of a job that does not use it, and a response changes as soon
as the API's view folds a change of what it renders (the same read-your-writes as without
the cache: a read reflects what the view has folded when it arrives). Requests that miss
the same (page, version) at once share one render (single flight). At most ``max_entries``
responses and ``max_bytes`` of bodies are kept (least recently used out).

A hit never enters the app: no routing, no in-flight slot (``InFlightLimit`` sits inside),
but the same token check as the routes when reads are protected. Only the watch-fed state
has versions; with ``EtcdState`` (etcd on every request) nothing is cached.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from tpflex_controller.api.errors import ApiError
from tpflex_controller.api.limits import bearer


@dataclass(frozen=True, slots=True)
class _Entry:
    version: object
    start: dict  # the http.response.start message
    body: bytes


def resource_of(path: str) -> tuple[str, str] | None:
    """The (resource, name) a cached GET path renders (``ApiStateCache.version``), None
    for a path that is not cached."""
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "" or parts[1] != "v1" or "" in parts[2:]:
        return None
    rest = parts[2:]
    if rest == ["status"]:
        return ("all", "")
    if rest[0] == "jobs" and len(rest) == 2:
        return ("job+goodput", rest[1])
    if rest[0] == "jobs" and len(rest) == 3 and rest[2] == "plan":
        return ("job", rest[1])
    if rest[0] in ("nodes", "gpus", "racks") and len(rest) == 1:
        return ("cluster", "")
    if rest[0] == "racks" and len(rest) == 2:
        return ("cluster", "")
    if rest[0] == "nodes" and (len(rest) == 2 or (len(rest) == 4 and rest[2] == "gpus")):
        return ("node", rest[1])
    return None


class ResponseCache:
    """Pure ASGI middleware; ``stats`` (``deps.response_stats``): hits, renders (misses
    rendered here), shared (misses that waited for another request's render), uncached
    (passed through)."""

    def __init__(self, app, *, deps, max_entries: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.app, self.deps = app, deps
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[str, bytes, bytes], _Entry] = OrderedDict()
        self._bytes = 0
        self._flights: dict[tuple, asyncio.Future] = {}
        self.stats = deps.response_stats if isinstance(getattr(deps, "response_stats", None), dict) else {}
        self.stats.update(hits=0, renders=0, shared=0, uncached=0)

    def _version(self, scope) -> object | None:
        if scope["type"] != "http" or scope["method"] != "GET" or self.max_entries <= 0:
            return None
        found = resource_of(scope["path"])
        version_of = getattr(self.deps.state, "version", None)
        if found is None or version_of is None:
            return None
        tokens = self.deps.tokens
        if tokens.protect_reads:  # the routes' check: a token of either scope
            token = bearer(scope["headers"])
            if token is None or tokens.scope_of(token) is None:
                return None  # the app answers 401
        resource, name = found
        try:
            if resource == "job+goodput":  # a job's page shows its goodput too
                steps = self.deps.steps
                return (version_of("job", name), steps.goodput(name) if steps is not None else None)
            return version_of(resource, name)
        except ApiError:
            return None  # not synced or etcd lost: the app answers 503

    async def __call__(self, scope, receive, send) -> None:
        version = self._version(scope)
        if version is None:
            self.stats["uncached"] += 1
            await self.app(scope, receive, send)
            return
        # the Host header too: a page's Link header names the URL the client asked for
        host = next((v for k, v in scope["headers"] if k == b"host"), b"")
        key = (scope["path"], scope["query_string"], host)
        entry = self._entries.get(key)
        if entry is not None and entry.version == version:
            self._entries.move_to_end(key)
            self.stats["hits"] += 1
            await _send(entry, send)
            return
        flight = self._flights.get((key, version))
        if flight is not None:
            entry = await asyncio.shield(flight)
            if entry is not None:
                self.stats["shared"] += 1
                await _send(entry, send)
                return
            self.stats["uncached"] += 1
            await self.app(scope, receive, send)  # the render failed or was no 200
            return
        flight = self._flights[(key, version)] = asyncio.get_running_loop().create_future()
        entry = None
        try:
            entry = await self._render(scope, receive, send, version)
        finally:
            del self._flights[(key, version)]
            flight.set_result(entry)
        if entry is not None:
            self.stats["renders"] += 1
            self._keep(key, entry)

    async def _render(self, scope, receive, send, version) -> _Entry | None:
        start: dict | None = None
        chunks: list[bytes] = []
        whole = True

        async def capture(message) -> None:
            nonlocal start, whole
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            else:
                whole = False
            await send(message)

        await self.app(scope, receive, capture)
        if start is None or start["status"] != 200 or not whole:
            return None
        return _Entry(version, start, b"".join(chunks))

    def _keep(self, key, entry: _Entry) -> None:
        if len(entry.body) > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old.body)
        self._entries[key] = entry
        self._bytes += len(entry.body)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self._bytes -= len(gone.body)

    def __len__(self) -> int:
        return len(self._entries)


async def _send(entry: _Entry, send) -> None:
    await send(entry.start)
    await send({"type": "http.response.body", "body": entry.body, "more_body": False})


class ResponseCacheCollector:
    """``tpflex_rest_response_cache_total{result}``: the REST process's GET requests of
    cached paths by outcome (hit, render, shared, uncached), read at scrape time."""

    NAME = "tpflex_rest_response_cache"
    HELP = "REST GET requests by response cache outcome (api/respcache.py)"

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats

    def describe(self):
        from prometheus_client.core import CounterMetricFamily

        return [CounterMetricFamily(self.NAME, self.HELP, labels=["result"])]

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.NAME, self.HELP, labels=["result"])
        for name in ("hits", "renders", "shared", "uncached"):
            family.add_metric([name], float(self.stats.get(name, 0)))
        yield family
