"""Racks (NVLink domains) with GPU state counts."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.deps import Deps
from tpflex_controller.api.errors import not_found
from tpflex_controller.api.paging import After, PageLimit, page
from tpflex_controller.api.params import RackName

router = APIRouter(prefix="/racks", tags=["racks"])


@router.get("", response_model=list[s.RackView], summary="List racks (paginated: limit, after)")
def list_racks(deps: Deps, request: Request, response: Response, limit: PageLimit = None,
               after: After = None) -> list[s.RackView]:
    reads = deps.reads
    snap = reads.cluster()
    names = page(sorted(snap.racks), str, limit, after, request, response)
    members = {n for r in snap.racks.values() for n in r.nodes}
    unlisted: dict[str, list[str]] = {}  # registered nodes no rack lists, by the rack they name
    for reg in snap.nodes.values():
        if reg.name not in members:
            unlisted.setdefault(reg.rack, []).append(reg.name)
    out = []
    for name in names:
        rack = snap.racks[name]
        rows = reads.node_rows([*rack.nodes, *unlisted.get(name, ())])
        gpus = [g for r in rows if r is not None for g in r.gpus if g.rack == name]
        out.append(views.rack_view(rack, gpus))
    return out


@router.get("/{rack}", response_model=s.RackDetail, summary="One rack with its GPUs")
def get_rack(rack: RackName, deps: Deps) -> s.RackDetail:
    snap = deps.reads.rack_cluster(rack)
    if snap is None:
        raise not_found(f"rack {rack!r} not found")
    stored = snap.racks[rack]
    gpus = [g for g in views.gpu_views(snap) if g.rack == rack]
    return s.RackDetail(**views.rack_view(stored, gpus).model_dump(), gpu_list=gpus)
