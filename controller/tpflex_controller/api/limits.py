"""Bounds on what REST requests may cost (both pure ASGI middleware).

``InFlightLimit``: at most N requests served at once, so that REST load cannot starve the
reconcile loop (they share one Python process). Requests beyond the bound wait in the
event loop (cheap) for up to ``wait_s``, then get 503 ``busy`` with ``Retry-After``.
Probes (/healthz, /readyz, /metrics) are never held back, nor the console's stream.

``BodyGuard``: a request body is read only after its token was checked, up to a size,
and only so many at once."""

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


BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def body_scope(method: str, path: str, protect_reads: bool) -> str | None:
    """The token scope a request with a body needs before its body is read: ``admin``
    for every mutation under /v1, ``reader`` for a job's dry-run when reads are protected, None
    for the others (the routes' own checks still apply)."""
    if method not in BODY_METHODS or not path.startswith("/v1/"):
        return None
    if method == "POST" and _is_dry_run(path):
        return "reader" if protect_reads else None
    return "admin"


def _is_dry_run(path: str) -> bool:
    """``/v1/jobs/<job>/dry-run``, the one route with a body that only reads (a job may be
    named ``dry-run``: ``DELETE /v1/jobs/dry-run`` is a mutation)."""
    parts = path.split("/")
    return len(parts) == 5 and parts[2] == "jobs" and parts[3] != "" and parts[4] == "dry-run"


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def auth_problem(tokens, method: str, path: str, headers) -> tuple[ErrorCode, str] | None:
    """Why the token of a request with a body does not allow it (None when it does)."""
    need = body_scope(method, path, tokens.protect_reads)
    if need is None:
        return None
    token = bearer(headers)
    if token is None:
        return ErrorCode.UNAUTHORIZED, "missing bearer token: send 'Authorization: Bearer <token>'"
    caller = tokens.caller_of(token)
    if caller is None:
        return ErrorCode.UNAUTHORIZED, "unknown bearer token"
    if need == "admin" and caller.scope != "admin":
        return ErrorCode.FORBIDDEN, "this token is read-only; an admin token is required"
    return None


class _TooLarge(Exception):
    pass


class BodyGuard:
    """Pure ASGI middleware for requests that may carry a body (POST, PUT, PATCH, DELETE):

    1. the bearer token is checked from the headers before a byte of the body is read
       (401 / 403 at once; the connection closes with the body unread);
    2. a body longer than ``max_bytes`` is refused with 413, from its Content-Length or
       as soon as more arrives, never buffered whole;
    3. at most ``max_bodies`` bodies are held at once (the others wait up to ``wait_s``,
       then 503 busy), so bodies take at most ``max_bodies x max_bytes`` of memory; a body
       must arrive within ``body_timeout_s`` (408 otherwise);
    4. a body that is not UTF-8 is refused with 422.
    The body read here is handed to the app unchanged."""

    def __init__(self, app, *, tokens, max_bytes: int, max_bodies: int, wait_s: float,
                 body_timeout_s: float = 10.0) -> None:
        self.app, self.tokens = app, tokens
        self.max_bytes, self.max_bodies, self.wait_s = max_bytes, max_bodies, wait_s
        self.body_timeout_s = body_timeout_s
        self._sem: asyncio.Semaphore | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS or not _has_body(scope["headers"]):
            await self.app(scope, receive, send)  # nothing to read: the routes' checks apply
            return
        problem = auth_problem(self.tokens, scope["method"], scope["path"], scope["headers"])
        if problem is not None:
            headers = {"WWW-Authenticate": "Bearer"} if problem[0] is ErrorCode.UNAUTHORIZED else None
            await error_response(*problem, headers=headers)(scope, receive, send)
            return
        if _content_length(scope["headers"]) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_bodies)
        try:
            await asyncio.wait_for(self._sem.acquire(), self.wait_s)
        except TimeoutError:
            msg = f"busy: {self.max_bodies} request bodies in flight for over {self.wait_s:g} s; retry"
            await error_response(ErrorCode.BUSY, msg, headers={"Retry-After": "1"})(scope, receive, send)
            return
        try:
            await self._with_body(scope, receive, send)
        finally:
            self._sem.release()

    async def _with_body(self, scope, receive, send) -> None:
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout_s)
        except _TooLarge:
            await self._too_large(scope, receive, send)
            return
        except TimeoutError:  # a client that trickles its body must not hold a slot forever
            msg = f"request body not received within {self.body_timeout_s:g} s (rest.body_timeout_s)"
            await error_response(ErrorCode.REQUEST_TIMEOUT, msg)(scope, receive, send)
            return
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"invalid request: the body is not UTF-8 (byte {exc.start})"
            await error_response(ErrorCode.INVALID_REQUEST, msg)(scope, receive, send)
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client went away; the app sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope, receive, send) -> None:
        msg = f"request body above the limit of {self.max_bytes} bytes (rest.max_body_bytes)"
        await error_response(ErrorCode.PAYLOAD_TOO_LARGE, msg)(scope, receive, send)


def _has_body(headers) -> bool:
    return any(
        (name.lower() == b"content-length" and value.strip() not in (b"0", b""))
        or name.lower() == b"transfer-encoding"
        for name, value in headers
    )


def _content_length(headers) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
