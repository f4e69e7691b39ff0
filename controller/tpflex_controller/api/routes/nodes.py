"""Nodes and their GPUs (registration + health + overrides merged); drain / undrain."""

from __future__ import annotations

import bisect
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from tpflex_proto import keys, types_pb2

from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.checks import unknown_gpu
from tpflex_controller.api.deps import Admin, Caller, Deps, check_rack_limit
from tpflex_controller.api.errors import not_found
from tpflex_controller.api.paging import After, PageLimit, gpu_cursor, page, parse_gpu_cursor
from tpflex_controller.api.params import NAME_PATTERN, GpuIndex, NodeName
from tpflex_controller.api.rows import json_list
from tpflex_controller.store import Snapshot

router = APIRouter(tags=["nodes"])


@router.get("/nodes", response_model=list[s.NodeView], summary="List nodes (paginated: limit, after)")
def list_nodes(deps: Deps, request: Request, response: Response, limit: PageLimit = None,
               after: After = None) -> Response:
    reads = deps.reads
    chosen = page(reads.node_names(), str, limit, after, request, response)
    return _json(json_list(r.json for r in reads.node_rows(chosen) if r is not None), response)


@router.get("/nodes/{node}", response_model=s.NodeDetail, summary="One node with its GPUs")
async def get_node(node: NodeName, deps: Deps) -> s.NodeDetail:
    found = deps.reads.node_cluster(node)
    if found is None:
        raise not_found(f"node {node!r} not found")
    snap, rack = found
    gpus = views.gpu_views(snap, node=node)
    return s.NodeDetail(**views.node_view(node, rack, snap, gpus).model_dump(), gpu_list=gpus)


@router.get("/gpus", response_model=list[s.GpuView], summary="List GPUs with health")
def list_gpus(
    deps: Deps,
    state: Annotated[str | None, Query(pattern="^(healthy|degraded|failed|drained)$")] = None,
    rack: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    *, request: Request, response: Response, limit: PageLimit = None, after: After = None,
) -> Response:
    """Sorted by (node, index); the cursor is ``node:index`` as X-Next-Cursor gives it.
    Walks the nodes from the cursor on, over their rendered rows (api/rows.py)."""
    reads = deps.reads
    # with a state: only the nodes with a GPU in it (O(page) from the cache's index)
    names = reads.nodes_in_state(state) if state is not None else reads.node_names()
    # the GPUs after (node, index) in (name, index) order: the names from the cursor's
    # node on, and in that node only the indices above the cursor's (comparing the
    # "node:index" strings would skip whole nodes: "node10:..." < "node1:..." as ":" sorts
    # after the digits, "-" and ".")
    cursor = parse_gpu_cursor(after) if after else None
    start = bisect.bisect_left(names, cursor[0]) if cursor else 0
    out: list[tuple[str, int, bytes]] = []
    more = False
    for row in _rows_from(reads, names, start):
        if row is None or (state is not None and state not in row.states) or (
                rack is not None and rack not in row.racks):
            continue
        name = row.name
        for g in row.gpus:
            if (state is not None and g.state != state) or (rack is not None and g.rack != rack):
                continue
            if cursor is not None and name == cursor[0] and g.index <= cursor[1]:
                continue
            if limit is not None and len(out) == limit:
                more = True
                break
            out.append((name, g.index, g.json))
        if more:
            break
    if more:
        cursor = gpu_cursor(*out[-1][:2])
        response.headers["X-Next-Cursor"] = cursor
        response.headers["Link"] = f'<{request.url.include_query_params(after=cursor, limit=limit)}>; rel="next"'
    return _json(json_list(g[2] for g in out), response)


def _rows_from(reads, names: list[str], start: int, chunk: int = 256):
    """The nodes' rows from ``start`` on, fetched a chunk at a time (a page stops early)."""
    for i in range(start, len(names), chunk):
        yield from reads.node_rows(names[i:i + chunk])


def _json(body: bytes, response: Response) -> Response:
    """Pre-rendered JSON (api/rows.py) with the headers the route set."""
    return Response(content=body, media_type="application/json", headers=dict(response.headers))


@router.get("/nodes/{node}/gpus/{index}", response_model=s.GpuView, summary="One GPU")
async def get_gpu(node: NodeName, index: GpuIndex, deps: Deps) -> s.GpuView:
    found = deps.reads.node_cluster(node)
    for g in views.gpu_views(found[0], node=node) if found is not None else ():
        if (g.node, g.index) == (node, index):
            return g
    raise not_found(f"GPU {node}:{index} not found")


@router.post(
    "/nodes/{node}/gpus/{index}/drain", response_model=s.DrainResult, status_code=202,
    summary="Drain a GPU (the leader re-plans without it)",
)
def drain_gpu(node: NodeName, index: GpuIndex, body: s.DrainRequest, deps: Deps,
              caller: Admin) -> s.DrainResult:
    _existing_gpu(deps, node, index, caller)
    at = deps.clock()

    def drained(old: types_pb2.GpuOverride | None) -> types_pb2.GpuOverride:
        if old is not None and old.drained and old.reason == body.reason:
            return old  # already so: no write
        return types_pb2.GpuOverride(
            gpu=types_pb2.GpuRef(node=node, index=index), drained=True, reason=body.reason,
            power_cap_w=old.power_cap_w if old else 0.0, at=at, by=caller.name,
        )

    old, _, revision = deps.store.update(keys.gpu_override(node, index), types_pb2.GpuOverride, drained)
    deps.settle(revision)
    changed = not (old and old.drained)  # only the request that moved the GPU says so
    return s.DrainResult(node=node, index=index, drained=True, changed=changed, reason=body.reason)


@router.post(
    "/nodes/{node}/gpus/{index}/undrain", response_model=s.DrainResult, status_code=202,
    summary="Undrain a GPU (removes the drain override)",
)
def undrain_gpu(node: NodeName, index: GpuIndex, deps: Deps, caller: Admin) -> s.DrainResult:
    _existing_gpu(deps, node, index, caller)
    at = deps.clock()

    def undrained(old: types_pb2.GpuOverride | None) -> types_pb2.GpuOverride | None:
        if old is None or not old.drained:
            return old  # nothing to undo: no write
        if old.power_cap_w > 0:  # keep an operator power pin
            return types_pb2.GpuOverride(gpu=old.gpu, power_cap_w=old.power_cap_w, at=at, by=caller.name)
        return None

    old, _, revision = deps.store.update(keys.gpu_override(node, index), types_pb2.GpuOverride, undrained)
    deps.settle(revision)
    changed = bool(old and old.drained)
    return s.DrainResult(node=node, index=index, drained=False, changed=changed)


def _existing_gpu(deps, node: str, index: int, caller: Caller) -> None:
    """404 for an unknown GPU; 403 for a token limited to racks that do not hold it."""
    found = deps.reads.node_cluster(node)
    snap = found[0] if found is not None else Snapshot()
    known = views.gpu_locations(snap, node)
    if (node, index) not in known:
        raise unknown_gpu((node, index), known)
    rack = found[1] if found is not None else None
    check_rack_limit(caller, rack, f"GPU {node}:{index} (rack {rack!r})")
