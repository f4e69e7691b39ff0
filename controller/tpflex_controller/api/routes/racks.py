"""Racks (NVLink domains) with GPU state counts; the rack inventory (admin writes of the
rack records, checked by ``rack_checks``); the registered nodes it is built from."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from tpflex_proto import keys, types_pb2

from tpflex_controller import convert, plandiff
from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.deps import Admin, ApiDeps, Deps, check_rack_limit
from tpflex_controller.api.errors import ApiError, ErrorCode, invalid, not_found
from tpflex_controller.api.paging import After, PageLimit, page
from tpflex_controller.api.params import RackName
from tpflex_controller.api.rows import json_list
from tpflex_controller.planner import plan
from tpflex_controller.planner.model import JobOverrides, PlanningError
from tpflex_controller.rack_checks import FIELDS, check_jobs_fit, check_rack
from tpflex_controller.spec_checks import InputError
from tpflex_controller.store import decode_or_skip

router = APIRouter(prefix="/racks", tags=["racks"])


@router.get("", response_model=list[s.RackView], summary="List racks (paginated: limit, after)")
def list_racks(deps: Deps, request: Request, response: Response, limit: PageLimit = None,
               after: After = None) -> Response:
    """O(the page): each rack's view is rendered once per change of it or of its nodes
    (a page of 100 racks re-derived from every node's rows took 27 ms of CPU at 10,000
    nodes)."""
    reads = deps.reads
    names = page(reads.rack_names(), str, limit, after, request, response)
    body = json_list(reads.rack_rows(names))
    return Response(content=body, media_type="application/json", headers=dict(response.headers))


@router.get("/{rack}", response_model=s.RackDetail, summary="One rack with its GPUs")
def get_rack(rack: RackName, deps: Deps) -> s.RackDetail:
    snap = deps.reads.rack_cluster(rack)
    if snap is None:
        raise not_found(f"rack {rack!r} not found")
    stored = snap.racks[rack]
    gpus = [g for g in views.gpu_views(snap) if g.rack == rack]
    return s.RackDetail(**views.rack_view(stored, gpus).model_dump(), gpu_list=gpus)


# ---- rack inventory: PUT / PATCH / DELETE (admin), ?dry_run=true validates only ----

DryRun = Annotated[bool, Query(description="validate and report what would change; write nothing")]
_ATTEMPTS = 5


@router.put(
    "/{rack}", response_model=s.RackWriteResult,
    summary="Create or replace a rack record (admin); ?dry_run=true validates only",
)
def put_rack(rack: RackName, body: s.RackRequest, deps: Deps, caller: Admin,
             dry_run: DryRun = False) -> s.RackWriteResult:
    check_rack_limit(caller, rack, f"rack {rack!r}")
    _same_name(rack, body.name)
    new = types_pb2.Rack(name=rack, **body.model_dump(exclude={"name"}))
    return _write(deps, rack, lambda old: new, dry_run)


@router.patch(
    "/{rack}", response_model=s.RackWriteResult,
    summary="Change some fields of a stored rack record (admin); ?dry_run=true validates only",
)
def patch_rack(rack: RackName, body: s.RackPatchRequest, deps: Deps, caller: Admin,
               dry_run: DryRun = False) -> s.RackWriteResult:
    check_rack_limit(caller, rack, f"rack {rack!r}")
    _same_name(rack, body.name)
    fields = body.model_dump(exclude={"name"}, exclude_none=True)
    if not fields:
        raise invalid("nothing to change: give at least one field of the rack record")

    def merged(old: types_pb2.Rack | None) -> types_pb2.Rack:
        if old is None:
            raise not_found(f"rack {rack!r} not found (PUT creates a rack)")
        new = types_pb2.Rack()
        new.CopyFrom(old)
        new.name = rack
        for field, value in fields.items():
            if field == "nodes":
                del new.nodes[:]
                new.nodes.extend(value)
            else:
                setattr(new, field, value)
        return new

    return _write(deps, rack, merged, dry_run)


@router.delete(
    "/{rack}", response_model=s.RackWriteResult,
    summary="Delete a rack record (admin); 409 while a job uses it; ?dry_run=true validates only",
)
def delete_rack(rack: RackName, deps: Deps, caller: Admin, dry_run: DryRun = False) -> s.RackWriteResult:
    check_rack_limit(caller, rack, f"rack {rack!r}")
    def gone(old: types_pb2.Rack | None) -> None:
        if old is None:
            raise not_found(f"rack {rack!r} not found")
        return None

    return _write(deps, rack, gone, dry_run)


def _same_name(rack: str, name: str | None) -> None:
    if name is not None and name != rack:
        raise invalid(f"the body's name {name!r} is not the path's rack {rack!r}")


def _write(deps: ApiDeps, rack: str, change, dry_run: bool) -> s.RackWriteResult:
    """Read the stored record and the spec guard, check the new record and every job that
    uses the rack against it, then write both compared (store.write_rack): a job spec
    registered meanwhile makes the write retry its checks."""
    store = deps.store
    for _attempt in range(_ATTEMPTS):
        guard = store.spec_guard_revision()
        kv = deps.etcd.get(keys.rack(rack))
        old = decode_or_skip(types_pb2.Rack, kv) if kv is not None else None
        new = change(old)
        if new is not None:
            _checked(check_rack, new)
        changes = _field_changes(old, new)
        if new is not None and old is not None and not changes:
            deps.settle(kv.mod_revision)
            return _result(rack, "unchanged", dry_run, new, [], [])
        specs = store.job_specs()
        users = _checked(check_jobs_fit, rack, new, store.racks(), specs)
        action = "deleted" if new is None else ("created" if old is None else "changed")
        if dry_run:
            impacts = [_impact(deps, job, specs[job], rack, old, new) for job in users]
            return _result(rack, action, True, new, changes, impacts)
        revision = store.write_rack(rack, new, rack_revision=kv.mod_revision if kv is not None else 0,
                                    guard_revision=guard)
        if revision:
            deps.settle(revision)
            impacts = [s.RackJobImpact(job=job, note="the controller leader re-plans the job "
                                                     "asynchronously") for job in users]
            return _result(rack, action, False, new, changes, impacts)
    raise ApiError(ErrorCode.CONFLICT, f"rack {rack!r} or the job specs kept changing while it was "
                                       f"checked; retry")


def _checked(check, *args):
    try:
        return check(*args)
    except InputError as exc:
        raise ApiError(ErrorCode.CONFLICT if exc.kind == "conflict" else ErrorCode.INVALID_REQUEST,
                       exc.message) from None


def _record(rack: types_pb2.Rack) -> dict:
    return {f: (list(getattr(rack, f)) if f == "nodes" else getattr(rack, f)) for f in FIELDS}


def _field_changes(old: types_pb2.Rack | None, new: types_pb2.Rack | None) -> list[s.RackFieldChange]:
    before = _record(old) if old is not None else {}
    after = _record(new) if new is not None else {}
    return [
        s.RackFieldChange(field=f, before=before.get(f), after=after.get(f))
        for f in FIELDS if before.get(f) != after.get(f)
    ]


def _result(rack: str, action: str, dry_run: bool, new: types_pb2.Rack | None,
            changes: list[s.RackFieldChange], jobs: list[s.RackJobImpact]) -> s.RackWriteResult:
    record = s.RackRecord(**_record(new)) if new is not None else None
    return s.RackWriteResult(rack=rack, action=action, dry_run=dry_run, record=record, changes=changes,
                             jobs=jobs)


def _impact(deps: ApiDeps, job: str, spec: types_pb2.JobSpec, rack: str, old: types_pb2.Rack | None,
            new: types_pb2.Rack | None) -> s.RackJobImpact:
    """The job's plan with the new record against its plan with the stored one (the
    cluster's current health and the job's overrides; the planner is pure)."""
    if new is None:
        return s.RackJobImpact(job=job, note="the rack is deleted")
    snap = deps.reads.cluster()
    try:
        before = _plan(deps, job, spec, dataclasses.replace(snap, racks=_with(snap.racks, rack, old)))
        after = _plan(deps, job, spec, dataclasses.replace(snap, racks=_with(snap.racks, rack, new)))
    except (PlanningError, ValueError) as exc:
        return s.RackJobImpact(job=job, note=f"the planner could not compare the plans: {exc}")
    changes = [views.change_view(c) for c in plandiff.diff(before, after)]
    note = "the next plan changes as listed" if changes else "the next plan is the same"
    return s.RackJobImpact(job=job, changes=changes, note=note)


def _with(racks: dict, rack: str, record: types_pb2.Rack | None) -> dict:
    out = dict(racks)
    if record is None:
        out.pop(rack, None)
    else:
        out[rack] = record
    return out


def _plan(deps: ApiDeps, job: str, spec: types_pb2.JobSpec, snap) -> types_pb2.Plan:
    state = convert.cluster_state(snap)  # the racks' limits made tighter by the devices', as the leader plans
    model = convert.job_spec(spec, state.racks)
    try:
        overrides = convert.job_overrides(deps.reads.job_override(job))
    except ValueError:  # an unknown stored policy: plan as if there were no override
        overrides = JobOverrides()
    planner = deps.planner if deps.planner is not None else plan
    result = planner(state, model, power_model=deps.power_model,
                     overrides=overrides, now=deps.clock())
    return convert.plan_to_proto(result, 0, cause="rack dry-run")


# ---- what the agents registered: the input of `tpflexctl racks propose` ----

inventory = APIRouter(tags=["racks"])


@inventory.get("/inventory/nodes", response_model=list[s.NodeInventory],
               summary="Registered nodes with their reported rack and GPU power limits")
def node_inventory(deps: Deps) -> list[s.NodeInventory]:
    snap = deps.reads.cluster()
    listed = {n for r in snap.racks.values() for n in r.nodes}
    return [
        s.NodeInventory(
            name=name, rack=node.rack, rack_source=node.rack_source, assigned=name in listed,
            gpus=[s.NodeGpuInventory(
                index=g.index, name=g.name, min_limit_w=g.min_limit_w, default_limit_w=g.default_limit_w,
                max_limit_w=g.max_limit_w, fabric_cluster_uuid=g.fabric_cluster_uuid,
                fabric_clique_id=g.fabric_clique_id) for g in sorted(node.gpus, key=lambda g: g.index)],
        )
        for name, node in sorted(snap.nodes.items())
    ]


def unassigned_nodes(snap) -> list[s.UnassignedNodeView]:
    """Registered nodes that no rack record lists, each with why (sorted by node)."""
    listed = {n for r in snap.racks.values() for n in r.nodes}
    out = []
    for name, node in sorted(snap.nodes.items()):
        if name in listed:
            continue
        if node.rack not in snap.racks:
            reason = f"no rack record {node.rack!r}" if node.rack else "the node reported no rack"
        else:
            reason = f"rack record {node.rack!r} does not list node {name!r}"
        out.append(s.UnassignedNodeView(node=name, rack=node.rack, reason=reason))
    return out


class UnassignedNodesCollector:
    """``tpflex_nodes_unassigned``: registered nodes that no rack record lists (their
    GPUs are in no plan), counted from the API's view at scrape time; no sample while the
    view is not loaded."""

    NAME = "tpflex_nodes_unassigned"
    HELP = "Registered nodes that no rack record lists (the planner does not use their GPUs)"

    def __init__(self, deps: ApiDeps) -> None:
        self.deps = deps

    def describe(self):
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(self.NAME, self.HELP)]

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(self.NAME, self.HELP)
        try:
            snap = self.deps.reads.cluster()
        except Exception:  # noqa: BLE001 -- a scrape never fails on the view (not synced, etcd down)
            yield family
            return
        listed = {n for r in snap.racks.values() for n in r.nodes}
        family.add_metric([], float(sum(1 for name in snap.nodes if name not in listed)))
        yield family
