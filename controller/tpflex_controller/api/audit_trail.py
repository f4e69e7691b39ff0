"""The REST API's audit trail: one ``tpflex.audit`` record (tpflex_controller.audit) per
mutating call under /v1 (POST, PUT, PATCH, DELETE; a job's dry-run only reads and is not
one), whatever its outcome, refusals of read-only and unknown tokens included.

Pure ASGI middleware, outermost: it sees every answer, also those of the middleware
inside it (``BodyGuard``'s 401/403/413, ``InFlightLimit``'s 503). Each record has ``who``
(the token's name; ``anonymous`` without a known token), ``what`` (``METHOD
route-template``), ``target`` (the concrete path), ``outcome`` (``ok``; ``denied`` for
401/403; ``invalid`` for another 4xx; ``error`` for a 5xx or no answer), ``status`` and
``request_id`` (the request's ``X-Request-Id`` when it gives a usable one, else a fresh
one; sent back in the response's ``X-Request-Id``), and ``reason`` when the JSON body had
one."""

from __future__ import annotations

import json
import re

from tpflex_controller import audit
from tpflex_controller.api.limits import BODY_METHODS, _is_dry_run, bearer

REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
BODY_KEPT = 16 << 10  # the first bytes of a body looked at for its "reason"


def audited(method: str, path: str) -> bool:
    return method in BODY_METHODS and path.startswith("/v1/") and not (
        method == "POST" and _is_dry_run(path))


def request_id_of(headers) -> str:
    """The client's ``X-Request-Id``, bounded (64 characters) and cut to the characters
    ``A-Z a-z 0-9 . _ : -`` (nothing a log line could be forged with); a fresh id when it
    gave none or nothing of it is left."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            cleaned = _UNSAFE.sub("", value.decode("latin-1"))[:64]
            if _REQUEST_ID.fullmatch(cleaned):
                return cleaned
            break
    return audit.request_id()


def outcome_of(status: int | None) -> str:
    if status is None or status >= 500:
        return "error"
    if status in (401, 403):
        return "denied"
    if status >= 400:
        return "invalid"
    return "ok"


class RouteTemplates:
    """The API's path templates (``/v1/jobs/{job}``) by method, from its OpenAPI paths
    (read once, on first use); ``of(method, path)`` -> the template that path matches
    (with that method when one does), else the concrete path."""

    def __init__(self, app) -> None:
        self.app = app
        self._table: list[tuple[re.Pattern, str, frozenset[str]]] | None = None

    def _build(self) -> list[tuple[re.Pattern, str, frozenset[str]]]:
        try:
            paths = self.app.openapi().get("paths", {})
        except Exception:  # no schema: concrete paths only
            paths = {}
        table = []
        for template, ops in paths.items():
            pattern = re.escape(template)
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", pattern)
            table.append((re.compile(pattern), template, frozenset(m.upper() for m in ops)))
        return table

    def of(self, method: str, path: str) -> str:
        if self._table is None:
            self._table = self._build()
        other = None
        for pattern, template, methods in self._table:
            if pattern.fullmatch(path):
                if method in methods:
                    return template
                other = other or template
        return other or path


def reason_of(body: bytes) -> str | None:
    """The ``reason`` of a JSON object body, or None (never raises: a hostile body, e.g.
    nested 100,000 deep, is the app's to refuse, not the audit's to fail on)."""
    if b'"reason"' not in body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return reason if isinstance(reason, str) and reason else None


class AuditTrail:
    """Pure ASGI middleware writing the audit record of each mutating call; ``tokens`` is
    the API's :class:`~tpflex_controller.api.deps.TokenConfig`, ``router`` what the route
    templates are read from (the FastAPI app)."""

    def __init__(self, app, *, tokens, router) -> None:
        self.app, self.tokens = app, tokens
        self.templates = RouteTemplates(router)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not audited(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope["headers"])
        token = bearer(scope["headers"])
        caller = self.tokens.caller_of(token) if token is not None else None
        what = f"{scope['method']} {self.templates.of(scope['method'], scope['path'])}"
        body = bytearray()
        done = False

        def write(status: int | None) -> None:
            nonlocal done
            done = True
            try:
                reason = reason_of(bytes(body)) if body else None
            except Exception:  # the record is written whatever the body was
                reason = None
            audit.record(
                who=caller.name if caller is not None else "anonymous", what=what,
                target=scope["path"], outcome=outcome_of(status), request_id=rid,
                status=status, reason=reason,
            )

        async def reading():
            message = await receive()
            if message["type"] == "http.request" and len(body) < BODY_KEPT:
                body.extend(message.get("body", b"")[:BODY_KEPT - len(body)])
            return message

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                # recorded before the client sees the answer (a client that reads the
                # audit trail after its call finds the call in it)
                write(message["status"])
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, reading, sending)
        finally:
            if not done:  # no answer at all: the app failed or the client went away
                write(None)
