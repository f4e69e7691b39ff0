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
    snap = deps.reads.cluster()
    names = page(sorted(snap.racks), str, limit, after, request, response)
    snap.racks = {n: snap.racks[n] for n in names}
    by_rack: dict[str, list[s.GpuView]] = {}
    for g in views.gpu_views(snap):
        by_rack.setdefault(g.rack, []).append(g)
    return [views.rack_view(snap.racks[name], by_rack.get(name, [])) for name in names]


@router.get("/{rack}", response_model=s.RackDetail, summary="One rack with its GPUs")
async def get_rack(rack: RackName, deps: Deps) -> s.RackDetail:
    snap = deps.reads.rack_cluster(rack)
    if snap is None:
        raise not_found(f"rack {rack!r} not found")
    stored = snap.racks[rack]
    gpus = [g for g in views.gpu_views(snap) if g.rack == rack]
    return s.RackDetail(**views.rack_view(stored, gpus).model_dump(), gpu_list=gpus)
