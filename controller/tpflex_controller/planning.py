"""What one committed decision writes: plan bytes, desired power per node, the event
(pure functions of the view and the planner's result; no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Cmp, Op

from tpflex_controller.cache import ClusterView, PlanRecord
from tpflex_controller.election import PlanCommit
from tpflex_controller.planbytes import PlanEncoder
from tpflex_controller.planner.model import PlanResult, SuspendedPin

# plan(cluster, job, *, policy=None, power_model=None, overrides=None, now=0.0) -> PlanResult
PlanFn = Callable[..., PlanResult]

MAX_EVENT_REASONS = 64


def default_plan_fn() -> PlanFn:
    from tpflex_controller.planner import plan  # the planner's pure entry point

    return plan


@dataclass
class Planned:
    job: str
    result: PlanResult
    prev: PlanRecord | None
    cause: str
    detected_at: float
    planned_at: float


def build_commit(
    view: ClusterView, p: Planned, *, history_size: int, encoder: PlanEncoder
) -> tuple[PlanCommit, dict[str, types_pb2.NodePowerPlan], types_pb2.Event]:
    generation = p.prev.generation + 1 if p.prev is not None else 1
    raw = encoder.encode(p.result, generation, cause=p.cause, now=p.planned_at)
    old_caps = p.prev.decision().power_caps if p.prev is not None else {}
    power = desired_power(view, old_caps, p.result.power_caps)
    seq = view.next_event_seq()
    event = types_pb2.Event(
        seq=seq,
        at=p.planned_at,
        kind="plan_committed",
        job=p.job,
        generation=generation,
        cause=p.cause,
        reasons=list(p.result.reasons[:MAX_EVENT_REASONS]),
        phases=[
            types_pb2.PhaseTiming(phase="detected", at=p.detected_at),
            types_pb2.PhaseTiming(phase="committed", at=p.planned_at),
        ],
    )
    trim = view.event_seqs[0] if len(view.event_seqs) >= view.event_log_size else 0
    commit = PlanCommit(
        job=p.job,
        generation=generation,
        plan_bytes=raw,
        prev_plan_mod_revision=p.prev.mod_revision if p.prev is not None else 0,
        power={n: (codec.encode(np), view.power.get(n, (None, 0))[1]) for n, np in power.items()},
        event_seq=seq,
        event_bytes=codec.encode(event),
        trim_event_seq=trim,
        trim_history_generation=max(0, generation - history_size),
    )
    return commit, power, event


def desired_power(
    view: ClusterView, old_caps, new_caps
) -> dict[str, types_pb2.NodePowerPlan]:
    """The new desired power plan of every node whose caps change.

    Candidates are the nodes of GPUs whose cap differs between the old and the new plan; a
    candidate's desired caps (every GPU of the node: the plan's cap or the rack's TDP) are
    compared with what ``power/<node>`` holds now (all TDP when absent), so a repeated pass
    writes nothing. O(changed GPUs), not O(boosted GPUs).
    """
    out: dict[str, types_pb2.NodePowerPlan] = {}
    changed = {g for g, w in new_caps.items() if old_caps.get(g) != w}
    changed.update(g for g in old_caps if g not in new_caps)
    for node in sorted({g[0] for g in changed}):
        rack = view.rack_of(node)
        if rack is None:
            continue
        indices = view.node_gpu_indices(node)
        want = {i: float(new_caps.get((node, i), rack.tdp_w)) for i in indices}
        current = view.power.get(node)
        have = (
            {c.gpu.index: c.cap_w for c in current[0].caps}
            if current is not None
            else {i: float(rack.tdp_w) for i in indices}
        )
        if want == have:
            continue
        generation = current[0].generation + 1 if current is not None else 1
        out[node] = types_pb2.NodePowerPlan(
            node=node,
            generation=generation,
            caps=[
                types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=want[i])
                for i in indices
            ],
        )
    return out


def changed_degrees(p: Planned) -> list[tuple[int, int]]:
    """(replica, degree) of the replicas whose degree the new plan changes (all of them
    when there is no previous decision to compare with)."""
    new = p.result.replicas
    old = p.prev.result.replicas if p.prev is not None and p.prev.result is not None else None
    if old is None or len(old) != len(new):
        return [(r.index, r.tp_degree) for r in new]
    return [
        (r.index, r.tp_degree)
        for r, o in zip(new, old, strict=True)
        if r is not o and r.tp_degree != o.tp_degree
    ]


def pin_events(p: Planned, generation: int, at: float) -> list[types_pb2.Event]:
    """``pin_suspended`` / ``pin_resumed`` events for the pins whose state the new plan
    changes (none when it changes none)."""
    out = []
    for kind, pins in pin_changes(p).items():
        if pins:
            what = "suspended" if kind == "pin_suspended" else "holds again, was suspended"
            reasons = [f"replica {x.replica}: TP pin {x.tp_degree} {what}: {x.reason}" for x in pins]
            out.append(types_pb2.Event(at=at, kind=kind, job=p.job, generation=generation,
                                       cause=p.cause, reasons=reasons))
    return out


def pin_changes(p: Planned) -> dict[str, list[SuspendedPin]]:
    """Pins the new plan suspends (``pin_suspended``) and the ones it no longer suspends
    (``pin_resumed``), compared with the previous decision."""
    old = p.prev.decision().suspended_pins if p.prev is not None else ()
    new = p.result.suspended_pins
    old_keys = {(x.replica, x.tp_degree) for x in old}
    new_keys = {(x.replica, x.tp_degree) for x in new}
    return {
        "pin_suspended": [x for x in new if (x.replica, x.tp_degree) not in old_keys],
        "pin_resumed": [x for x in old if (x.replica, x.tp_degree) not in new_keys],
    }


def build_retire(
    view: ClusterView, job: str
) -> tuple[list, list, dict[str, types_pb2.NodePowerPlan]] | None:
    """What removing a deleted job's plan writes: the plan and its history go, and the
    nodes whose caps the plan set go back to their TDP. (compare, ops, power) for one
    fenced transaction; None when the job has no plan."""
    rec = view.plans.get(job)
    if rec is None:
        return None
    power = desired_power(view, rec.decision().power_caps, {})
    compare = [Cmp.mod_revision(keys.job_plan(job), "==", rec.mod_revision)]
    ops = [Op.delete(keys.job_plan(job)), Op.delete_prefix(keys.job_prefix(job) + "history/")]
    for node, np in sorted(power.items()):
        compare.append(Cmp.mod_revision(keys.power(node), "==", view.power.get(node, (None, 0))[1]))
        ops.append(Op.put(keys.power(node), codec.encode(np)))
    return compare, ops, power
