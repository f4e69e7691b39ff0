"""The API's one error type and its mapping to HTTP (done once, here).

Every error response has the body ``{"error": {"code": ..., "message": ...}}``; a client
never sees a traceback. Domain errors raised below the edge (etcd unavailable, planning
errors) are translated here too.
"""

from __future__ import annotations

import enum
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from tpflex_proto.etcd import EtcdError, EtcdUnavailable

from tpflex_controller.planner.model import PlanningError
from tpflex_controller.store import UpdateConflict

log = logging.getLogger(__name__)


class ErrorCode(enum.StrEnum):
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TIMEOUT = "request_timeout"
    CONFLICT = "conflict"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_REQUEST = "invalid_request"
    ETCD_UNAVAILABLE = "etcd_unavailable"
    NOT_READY = "not_ready"
    BUSY = "busy"
    INTERNAL = "internal"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.CONFLICT: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.BUSY: 503,  # before the others: a bare 503 maps to the last one listed
    ErrorCode.ETCD_UNAVAILABLE: 503,
    ErrorCode.NOT_READY: 503,
    ErrorCode.INTERNAL: 500,
}

_BY_STATUS = {status: code for code, status in HTTP_STATUS.items()}


class ApiError(Exception):
    """A request that cannot be served; ``code`` decides the HTTP status."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]


def not_found(message: str) -> ApiError:
    return ApiError(ErrorCode.NOT_FOUND, message)


def invalid(message: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, message)


def error_response(code: ErrorCode, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"code": code.value, "message": message}}
    return JSONResponse(body, status_code=HTTP_STATUS[code], headers=headers)


def _format_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts) if parts else "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.code is ErrorCode.UNAUTHORIZED else None
        return error_response(exc.code, exc.message, headers)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ErrorCode.INVALID_REQUEST, _format_validation(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # a body FastAPI could not parse (too deeply nested, ...)
            return error_response(ErrorCode.INVALID_REQUEST, f"invalid request: {exc.detail}")
        code = _BY_STATUS.get(exc.status_code)
        if code is None:
            code = ErrorCode.INVALID_REQUEST if exc.status_code < 500 else ErrorCode.INTERNAL
            body = {"error": {"code": code.value, "message": str(exc.detail)}}
            return JSONResponse(body, status_code=exc.status_code)
        message = str(exc.detail)
        if code is ErrorCode.NOT_FOUND and message == "Not Found":
            message = "no such endpoint; see /openapi.json"
        return error_response(code, message)

    async def on_planning(_: Request, exc: PlanningError) -> JSONResponse:
        return error_response(ErrorCode.INVALID_REQUEST, str(exc))

    async def on_conflict(_: Request, exc: UpdateConflict) -> JSONResponse:
        return error_response(ErrorCode.CONFLICT, str(exc))

    async def on_etcd(request: Request, exc: EtcdError) -> JSONResponse:
        log.warning("etcd request failed path=%s error=%s", request.url.path, exc)
        what = "unreachable" if isinstance(exc, EtcdUnavailable) else "request failed"
        return error_response(ErrorCode.ETCD_UNAVAILABLE, f"etcd {what}; try again later ({exc})")

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error path=%s error=%r", request.url.path, exc, exc_info=exc)
        return error_response(ErrorCode.INTERNAL, "internal error; see the controller log")

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(PlanningError, on_planning)
    app.add_exception_handler(UpdateConflict, on_conflict)
    app.add_exception_handler(EtcdError, on_etcd)
    app.add_exception_handler(Exception, on_unexpected)
