"""A bound on the REST requests served at once, so that REST load cannot starve the
reconcile loop (they share one Python process). Requests beyond the bound wait in the
event loop (cheap) for up to ``wait_s``, then get 503 ``busy`` with ``Retry-After``.
Probes (/healthz, /readyz, /metrics) are never held back, nor the console's stream."""

from __future__ import annotations

import asyncio

from tpflex_controller.api.errors import ErrorCode, error_response

# probes, and the console's long-lived stream (bounded on its own: console.routes.MAX_STREAMS)
EXEMPT = frozenset({"/healthz", "/readyz", "/metrics", "/v1/console/stream"})


class InFlightLimit:
    """Pure ASGI middleware: at most ``limit`` requests inside the app at once."""

    def __init__(self, app, *, limit: int, wait_s: float) -> None:
        self.app = app
        self.limit = limit
        self.wait_s = wait_s
        self._sem: asyncio.Semaphore | None = None  # made on the serving loop

    async def __call__(self, scope, receive, send) -> None:
        if self.limit <= 0 or scope["type"] != "http" or scope["path"] in EXEMPT:
            await self.app(scope, receive, send)
            return
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limit)
        try:
            await asyncio.wait_for(self._sem.acquire(), self.wait_s)
        except TimeoutError:
            msg = f"busy: {self.limit} requests in flight for over {self.wait_s:g} s; retry"
            await error_response(ErrorCode.BUSY, msg, headers={"Retry-After": "1"})(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._sem.release()
