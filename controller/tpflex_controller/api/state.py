"""What the routes read, behind one small interface (``ApiState``), and two sources of it:

- :class:`tpflex_controller.api.cache.ApiStateCache` (the controller's): a watch-fed
  in-memory view, no etcd round trip per request;
- :class:`EtcdState`: reads etcd on every call (read-after-write for callers that write
  etcd themselves, e.g. tests; a one-node read still reads the whole cluster).
"""

from __future__ import annotations

from typing import Protocol

from tpflex_proto import codec, keys, types_pb2

from tpflex_controller import convert
from tpflex_controller.api import views
from tpflex_controller.api.errors import invalid, not_found
from tpflex_controller.api.index import NodeIndex
from tpflex_controller.api.rows import NodeRow, rack_members, render_node, render_rack
from tpflex_controller.api.tables import node_subset
from tpflex_controller.planner.model import JobSpec
from tpflex_controller.store import Snapshot, Store


class ApiState(Protocol):
    def revision(self) -> int: ...
    def wait_revision(self, revision: int, timeout: float) -> bool: ...
    def leader(self) -> types_pb2.LeaderRecord | None: ...
    def cluster(self) -> Snapshot: ...
    def node_cluster(self, node: str) -> tuple[Snapshot, str] | None: ...
    def rack_cluster(self, rack: str) -> Snapshot | None: ...
    def job(self, name: str) -> types_pb2.JobSpec | None: ...
    def jobs(self) -> dict[str, types_pb2.JobSpec]: ...
    def plan(self, job: str) -> types_pb2.Plan | None: ...
    def plan_history(self, job: str, limit: int = 1000) -> list[types_pb2.Plan]: ...
    def acks(self, job: str) -> dict[int, types_pb2.Ack]: ...
    def job_override(self, job: str) -> types_pb2.JobOverride | None: ...
    def events(self, limit: int = 100, job: str | None = None) -> list[types_pb2.Event]: ...
    def node_names(self) -> list[str]: ...
    def rack_count(self) -> int: ...
    def node_row(self, node: str) -> NodeRow | None: ...
    def node_rows(self, nodes: list[str]) -> list[NodeRow | None]: ...
    def rack_names(self) -> list[str]: ...
    def rack_rows(self, racks: list[str]) -> list[bytes]: ...
    def status_counts(self) -> tuple[int, int, tuple[int, ...]]: ...
    def nodes_in_state(self, state: str) -> list[str]: ...


def read_cluster(store: Store) -> Snapshot:
    """Racks, node registrations, health and GPU overrides (malformed values skipped)."""
    return Snapshot(
        racks=store.racks(), nodes=store.nodes(), health=store.health(),
        gpu_overrides=store.gpu_overrides(), gpu_holds=store.gpu_holds(),
    )


class EtcdState:
    """``ApiState`` read from etcd on every call."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def revision(self) -> int:
        return self.store.etcd.status().header.revision

    def wait_revision(self, revision: int, timeout: float) -> bool:
        return True  # every read goes to etcd: it already holds any write that answered

    def leader(self) -> types_pb2.LeaderRecord | None:
        """None when no leader key exists; an unreadable one still means a leader."""
        kv = self.store.etcd.get(keys.LEADER)
        if kv is None:
            return None
        try:
            return codec.decode(types_pb2.LeaderRecord, kv.value, kv.key)
        except codec.MalformedValue:
            return types_pb2.LeaderRecord(id="<unreadable>")

    def cluster(self) -> Snapshot:
        return read_cluster(self.store)

    def node_cluster(self, node: str) -> tuple[Snapshot, str] | None:
        snap = read_cluster(self.store)
        members = {n: r for r in snap.racks.values() for n in r.nodes}
        rack = members.get(node)
        reg = snap.nodes.get(node)
        if rack is None and reg is None:
            return None
        name = rack.name if rack is not None else reg.rack
        idx = {i for (n, i) in (*snap.gpu_overrides, *snap.gpu_holds) if n == node}
        return node_subset(snap, node, snap.racks.get(name), idx), name

    def rack_cluster(self, rack: str) -> Snapshot | None:
        snap = read_cluster(self.store)
        return snap if rack in snap.racks else None

    def job(self, name: str) -> types_pb2.JobSpec | None:
        return self.store.job(name)

    def jobs(self) -> dict[str, types_pb2.JobSpec]:
        return self.store.jobs()

    def plan(self, job: str) -> types_pb2.Plan | None:
        return self.store.plan(job)

    def plan_history(self, job: str, limit: int = 1000) -> list[types_pb2.Plan]:
        return self.store.plan_history(job)[-limit:]

    def acks(self, job: str) -> dict[int, types_pb2.Ack]:
        return self.store.acks(job)

    def job_override(self, job: str) -> types_pb2.JobOverride | None:
        return self.store.job_override(job)

    def events(self, limit: int = 100, job: str | None = None) -> list[types_pb2.Event]:
        return self.store.events(limit, job)

    def node_names(self) -> list[str]:
        return sorted(views.node_names(read_cluster(self.store)))

    def rack_count(self) -> int:
        return len(self.store.racks())

    def node_row(self, node: str) -> NodeRow | None:
        return render_node(node, self.node_cluster(node))

    def node_rows(self, nodes: list[str]) -> list[NodeRow | None]:
        return [self.node_row(n) for n in nodes]

    def rack_names(self) -> list[str]:
        return sorted(self.store.racks())

    def rack_rows(self, racks: list[str]) -> list[bytes]:
        """The ``RackView`` JSON of each of ``racks`` that exists, in order."""
        snap = read_cluster(self.store)
        members = rack_members(snap)
        return [render_rack(snap.racks[r], self.node_rows(list(members[r]))) for r in racks if r in snap.racks]

    def status_counts(self) -> tuple[int, int, tuple[int, ...]]:
        index = NodeIndex()
        names = self.node_names()
        index.apply(zip(names, self.node_rows(names), strict=True))
        return index.totals()

    def nodes_in_state(self, state: str) -> list[str]:
        return self.node_names()  # a superset: the caller filters by state


def job_spec(state: ApiState, name: str) -> types_pb2.JobSpec:
    spec = state.job(name)
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
