"""Reads of the current state for the routes (through the Store; I/O lives here)."""

from __future__ import annotations

from tpflex_proto import codec, keys, types_pb2

from tpflex_controller import convert
from tpflex_controller.api.errors import invalid, not_found
from tpflex_controller.planner.model import JobSpec
from tpflex_controller.store import Snapshot, Store


def read_cluster(store: Store) -> Snapshot:
    """Racks, node registrations, health and GPU overrides (malformed values skipped)."""
    return Snapshot(
        racks=store.racks(), nodes=store.nodes(), health=store.health(),
        gpu_overrides=store.gpu_overrides(),
    )


def job_spec(store: Store, name: str) -> types_pb2.JobSpec:
    spec = store.job(name)
    if spec is None:
        raise not_found(f"job {name!r} not found")
    return spec


def planner_job(spec: types_pb2.JobSpec, snap: Snapshot) -> JobSpec:
    """The planner's view of a stored spec; a spec that cannot be planned is a 422."""
    racks = {name: convert.rack_info(r) for name, r in snap.racks.items()}
    try:
        return convert.job_spec(spec, racks)
    except ValueError as exc:  # PlanningError or an unknown stored policy
        raise invalid(f"job {spec.name!r} cannot be planned as stored: {exc}") from None


def leader(store: Store) -> types_pb2.LeaderRecord | None:
    """The elected leader's record, or None when no leader key exists. A leader key
    whose value this schema cannot read still means a leader is elected."""
    kv = store.etcd.get(keys.LEADER)
    if kv is None:
        return None
    try:
        return codec.decode(types_pb2.LeaderRecord, kv.value, kv.key)
    except codec.MalformedValue:
        return types_pb2.LeaderRecord(id="<unreadable>")
