"""Nodes and their GPUs (registration + health + overrides merged); drain / undrain."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from tpflex_proto import keys, types_pb2

from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.checks import unknown_gpu
from tpflex_controller.api.deps import Admin, Deps
from tpflex_controller.api.errors import not_found
from tpflex_controller.api.paging import After, PageLimit, gpu_cursor, page
from tpflex_controller.api.params import NAME_PATTERN, GpuIndex, NodeName
from tpflex_controller.store import Snapshot

router = APIRouter(tags=["nodes"])


@router.get("/nodes", response_model=list[s.NodeView], summary="List nodes (paginated: limit, after)")
def list_nodes(deps: Deps, request: Request, response: Response, limit: PageLimit = None,
               after: After = None) -> list[s.NodeView]:
    snap = deps.reads.cluster()
    names = views.node_names(snap)
    chosen = page(sorted(names), str, limit, after, request, response)
    by_node: dict[str, list[s.GpuView]] = {}
    for g in views.gpu_views(snap):
        by_node.setdefault(g.node, []).append(g)
    return [views.node_view(name, names[name], snap, by_node.get(name, [])) for name in chosen]


@router.get("/nodes/{node}", response_model=s.NodeDetail, summary="One node with its GPUs")
async def get_node(node: NodeName, deps: Deps) -> s.NodeDetail:
    found = deps.reads.node_cluster(node)
    if found is None:
        raise not_found(f"node {node!r} not found")
    snap, rack = found
    gpus = [g for g in views.gpu_views(snap) if g.node == node]
    return s.NodeDetail(**views.node_view(node, rack, snap, gpus).model_dump(), gpu_list=gpus)


@router.get("/gpus", response_model=list[s.GpuView], summary="List GPUs with health")
def list_gpus(
    deps: Deps,
    state: Annotated[str | None, Query(pattern="^(healthy|degraded|failed|drained)$")] = None,
    rack: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    *, request: Request, response: Response, limit: PageLimit = None, after: After = None,
) -> list[s.GpuView]:
    """Sorted by (node, index); the cursor is ``node:index`` as X-Next-Cursor gives it."""
    gpus = views.gpu_views(deps.reads.cluster())
    chosen = [g for g in gpus if (state is None or g.state == state) and (rack is None or g.rack == rack)]
    return page(chosen, lambda g: gpu_cursor(g.node, g.index), limit, after, request, response)


@router.get("/nodes/{node}/gpus/{index}", response_model=s.GpuView, summary="One GPU")
async def get_gpu(node: NodeName, index: GpuIndex, deps: Deps) -> s.GpuView:
    found = deps.reads.node_cluster(node)
    for g in views.gpu_views(found[0]) if found is not None else ():
        if (g.node, g.index) == (node, index):
            return g
    raise not_found(f"GPU {node}:{index} not found")


@router.post(
    "/nodes/{node}/gpus/{index}/drain", response_model=s.DrainResult, status_code=202,
    summary="Drain a GPU (the leader re-plans without it)",
)
def drain_gpu(node: NodeName, index: GpuIndex, body: s.DrainRequest, deps: Deps, _: Admin) -> s.DrainResult:
    _existing_gpu(deps, node, index)
    at = deps.clock()

    def drained(old: types_pb2.GpuOverride | None) -> types_pb2.GpuOverride:
        if old is not None and old.drained and old.reason == body.reason:
            return old  # already so: no write
        return types_pb2.GpuOverride(
            gpu=types_pb2.GpuRef(node=node, index=index), drained=True, reason=body.reason,
            power_cap_w=old.power_cap_w if old else 0.0, at=at,
        )

    old, _ = deps.store.update(keys.gpu_override(node, index), types_pb2.GpuOverride, drained)
    changed = not (old and old.drained)  # only the request that moved the GPU says so
    return s.DrainResult(node=node, index=index, drained=True, changed=changed, reason=body.reason)


@router.post(
    "/nodes/{node}/gpus/{index}/undrain", response_model=s.DrainResult, status_code=202,
    summary="Undrain a GPU (removes the drain override)",
)
def undrain_gpu(node: NodeName, index: GpuIndex, deps: Deps, _: Admin) -> s.DrainResult:
    _existing_gpu(deps, node, index)
    at = deps.clock()

    def undrained(old: types_pb2.GpuOverride | None) -> types_pb2.GpuOverride | None:
        if old is None or not old.drained:
            return old  # nothing to undo: no write
        if old.power_cap_w > 0:  # keep an operator power pin
            return types_pb2.GpuOverride(gpu=old.gpu, power_cap_w=old.power_cap_w, at=at)
        return None

    old, _ = deps.store.update(keys.gpu_override(node, index), types_pb2.GpuOverride, undrained)
    changed = bool(old and old.drained)
    return s.DrainResult(node=node, index=index, drained=False, changed=changed)


def _existing_gpu(deps, node: str, index: int):
    found = deps.reads.node_cluster(node)
    snap = found[0] if found is not None else Snapshot()
    known = {g: r for g, r in views.gpu_locations(snap).items() if g[0] == node}
    if (node, index) not in known:
        raise unknown_gpu((node, index), known)
