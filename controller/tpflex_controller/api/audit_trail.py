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

from starlette.routing import Match

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


def route_template(app, scope) -> str:
    """The path template of the route a request goes to (``/v1/jobs/{job}``), or its
    concrete path when none matches."""
    partial = None
    for route in getattr(app, "routes", ()):
        try:
            match, _ = route.matches(scope)
        except Exception:  # a route that cannot judge this scope is not it
            continue
        if match is Match.FULL:
            return getattr(route, "path", scope["path"])
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path", None)
    return partial or scope["path"]


def reason_of(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return reason if isinstance(reason, str) and reason else None


class AuditTrail:
    """Pure ASGI middleware writing the audit record of each mutating call; ``tokens`` is
    the API's :class:`~tpflex_controller.api.deps.TokenConfig`, ``router`` what the route
    templates are read from (the FastAPI app)."""

    def __init__(self, app, *, tokens, router) -> None:
        self.app, self.tokens, self.router = app, tokens, router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not audited(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope["headers"])
        token = bearer(scope["headers"])
        caller = self.tokens.caller_of(token) if token is not None else None
        what = f"{scope['method']} {route_template(self.router, scope)}"
        body = bytearray()
        status: int | None = None

        async def reading():
            message = await receive()
            if message["type"] == "http.request" and len(body) < BODY_KEPT:
                body.extend(message.get("body", b"")[:BODY_KEPT - len(body)])
            return message

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, reading, sending)
        finally:
            audit.record(
                who=caller.name if caller is not None else "anonymous", what=what,
                target=scope["path"], outcome=outcome_of(status), request_id=rid,
                status=status, reason=reason_of(bytes(body)) if body else None,
            )
