"""``/ui`` (the console page and its two assets, no data, no auth) and the data it reads:
``/v1/console/session`` (which scope a token has) and ``/v1/console/stream`` (a server-sent
event stream: one ``snapshot``, then ``racks``/``jobs``/``events``/``leader``/``revision``
messages pushed as the API's watch-fed view changes).

Auth: both data endpoints need a known token of either scope, whatever ``protect_reads``
says: a wrong token gets 401 and the page shows its login screen. The page reads the
stream with ``fetch`` and the ``Authorization`` header (not ``EventSource``, which cannot
send headers): the token never appears in a URL, so never in access logs, proxy logs,
browser history or a ``Referer``, and the server keeps no ticket state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from tpflex_controller.api.console.live import ConsoleView
from tpflex_controller.api.deps import Deps, Scope
from tpflex_controller.api.errors import ApiError, ErrorCode
from tpflex_controller.api.feed import Change

log = logging.getLogger(__name__)

pages = APIRouter(tags=["console"], include_in_schema=False)
api = APIRouter(prefix="/console", tags=["console"])

HEARTBEAT_S = 5.0  # a comment (or changed goodput) at least this often keeps proxies open
MAX_STREAMS = 64  # console streams served at once per API process
# a stream whose client takes no data for this long is ended and its slot given back: a
# client that stopped reading held its slot for ever (64 of them locked every console out)
# and made its stream keep every later change
SEND_TIMEOUT_S = 30.0
_ASSETS = {
    "console.js": "text/javascript", "console-map.js": "text/javascript",
    "console-actions.js": "text/javascript", "console.css": "text/css",
}
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}


def _asset(name: str) -> bytes:
    return resources.files("tpflex_controller.api.console").joinpath("static", name).read_bytes()


@pages.get("/ui")
async def console_page() -> Response:
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@pages.get("/ui/{name}")
async def console_asset(name: str) -> Response:
    if name not in _ASSETS:
        raise ApiError(ErrorCode.NOT_FOUND, f"no console asset {name!r}")
    return Response(_asset(name), media_type=_ASSETS[name], headers=_HEADERS)


@api.get("/session", summary="The scope of the caller's token (the console's login check)")
async def session(caller: Scope) -> dict:
    return {"scope": caller.scope, "name": caller.name}


@api.get("/stream", include_in_schema=False)  # an endless stream: docs/console.md, not OpenAPI
async def stream(request: Request, deps: Deps, caller: Scope) -> StreamingResponse:
    feed = deps.reads
    if not hasattr(feed, "subscribe"):
        raise ApiError(ErrorCode.NOT_READY, "live updates need the watch-fed view of etcd")
    deps.reads.revision()  # 503 now (not inside the stream) while the view is not current
    counter = _counter(request)
    if not counter.acquire():
        raise ApiError(ErrorCode.BUSY, f"busy: {MAX_STREAMS} console streams open; retry")
    view = ConsoleView(deps.reads, deps.steps, caller.scope)
    return _BoundedStream(
        _messages(view, feed, counter), media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


class _BoundedStream(StreamingResponse):
    """A stream each of whose sends must be taken by the client within SEND_TIMEOUT_S
    (the server's socket buffer full for that long: the client stopped reading). Then the
    stream ends: its messages' generator is closed at once (giving back its slot and its
    subscription) and the connection is left for the server to close."""

    async def stream_response(self, send) -> None:
        timeout = SEND_TIMEOUT_S

        async def bounded(message) -> None:
            await asyncio.wait_for(send(message), timeout)

        try:
            await super().stream_response(bounded)
        except TimeoutError:
            log.warning("console stream ended: the client took no data for %g s", timeout)
            await self.body_iterator.aclose()


class _StreamCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = 0

    def acquire(self) -> bool:
        with self._lock:
            if self.open >= MAX_STREAMS:
                return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.open -= 1


def _counter(request: Request) -> _StreamCounter:
    state = request.app.state
    if not hasattr(state, "console_streams"):
        state.console_streams = _StreamCounter()
    return state.console_streams


def sse(name: str, data: object) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _messages(view: ConsoleView, feed, counter: _StreamCounter):
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    lock = threading.Lock()
    pending: list[Change] = []

    def on_changes(changes: list[Change]) -> None:  # the feeder's thread
        with lock:
            pending.extend(changes)
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop is gone (server shutting down)
            pass

    unsubscribe = feed.subscribe(on_changes)
    try:
        yield sse("snapshot", await asyncio.to_thread(view.snapshot))
        while True:
            try:
                await asyncio.wait_for(wake.wait(), HEARTBEAT_S)
            except TimeoutError:
                jobs = await asyncio.to_thread(view.refresh_jobs)
                yield sse("jobs", jobs) if jobs is not None else b": keepalive\n\n"
                continue
            wake.clear()
            with lock:
                batch = pending[:]
                pending.clear()
            for name, data in await asyncio.to_thread(view.apply, batch):
                yield sse(name, data)
    except ApiError as exc:  # the view lost etcd: end the stream; the page reconnects
        yield sse("error", {"code": exc.code.value, "message": exc.message})
    finally:
        unsubscribe()
        counter.release()

