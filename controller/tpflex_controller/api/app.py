"""The REST API factory: ``create_app(deps)`` -> a FastAPI app; nothing at import time."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI

from tpflex_controller import __version__
from tpflex_controller.api import schemas as s
from tpflex_controller.api.audit_trail import AuditTrail
from tpflex_controller.api.console import routes as console
from tpflex_controller.api.deps import ApiDeps, require_reader
from tpflex_controller.api.errors import install_error_handlers
from tpflex_controller.api.limits import BodyGuard, InFlightLimit
from tpflex_controller.api.respcache import ResponseCache
from tpflex_controller.api.routes import credentials, events, jobs, nodes, racks, system

_ERRORS = {
    401: {"model": s.ErrorBody, "description": "no or unknown bearer token"},
    403: {"model": s.ErrorBody, "description": "read-only token on a mutating call, or an admin "
          "token limited to other jobs or racks"},
    404: {"model": s.ErrorBody, "description": "unknown rack, node, GPU or job"},
    413: {"model": s.ErrorBody, "description": "request body above rest.max_body_bytes"},
    422: {"model": s.ErrorBody, "description": "impossible or malformed request"},
    503: {"model": s.ErrorBody, "description": "etcd unreachable, state not loaded, or busy"},
}

DESCRIPTION = """tpflex controller API: inspect racks, nodes, GPUs, jobs, plans and events;
drain/undrain GPUs, force a job's reconfiguration, dry-run a plan. Mutating calls need
`Authorization: Bearer <admin token>`; each is recorded on the `tpflex.audit` logger
under the token's name, with the request's `X-Request-Id` (echoed back). Errors: `{"error": {"code": ..., "message": ...}}`."""


def create_app(deps: ApiDeps) -> FastAPI:
    # no redirects: /v1/nodes/%2f is a 404 with a typed error, not a 307 to another path
    app = FastAPI(title="tpflex controller", version=__version__, description=DESCRIPTION,
                  redirect_slashes=False)
    app.state.deps = deps
    if getattr(deps, "_unassigned_collector", None) is None:  # once per deps (and registry)
        deps._unassigned_collector = racks.UnassignedNodesCollector(deps)
        deps.registry.register(deps._unassigned_collector)
    install_error_handlers(app)
    app.include_router(system.probes)
    v1 = APIRouter(prefix="/v1", responses=_ERRORS, dependencies=[Depends(require_reader)])
    for router in (system.status_router, racks.router, racks.inventory, nodes.router, jobs.router,
                   credentials.router, events.router):
        v1.include_router(router)
    v1.include_router(console.api)
    app.include_router(v1)
    app.include_router(console.pages)
    if deps.max_in_flight > 0:
        app.add_middleware(InFlightLimit, limit=deps.max_in_flight, wait_s=deps.busy_wait_s)
    # outside the in-flight bound: a cached response costs no slot (api/respcache.py)
    app.add_middleware(ResponseCache, deps=deps, max_entries=deps.response_cache_entries,
                       max_bytes=deps.response_cache_bytes)
    # outermost: a body is read only after its token was checked, and within the bounds
    app.add_middleware(BodyGuard, tokens=deps.tokens, max_bytes=deps.max_body_bytes,
                       max_bodies=deps.max_bodies, wait_s=deps.busy_wait_s,
                       body_timeout_s=deps.body_timeout_s)
    # outermost of all: every mutating call's audit record (api/audit_trail.py), the
    # refusals of the middleware above included
    app.add_middleware(AuditTrail, tokens=deps.tokens, router=app)
    return app
