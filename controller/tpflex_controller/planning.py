"""What one committed decision writes: the plan's changed parts, desired power per node,
the event (pure functions of the view and the planner's result), and the fenced commit of
it (``commit_plan``, the only I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, islice
from operator import attrgetter

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Cmp, Op, TxnBuilder
from tpflex_proto.wire import varint_len as _varint_len

from tpflex_controller.cache import ClusterView, NodePower, PlanRecord
from tpflex_controller.election import Conflict, LeaderSession
from tpflex_controller.planbytes import PlanEncoder
from tpflex_controller.planner.model import (
    GpuKey,
    PlanResult,
    SuspendedPin,
    changed_cap_parts,
    changed_since,
    moved,
)

MAX_EVENT_REASONS = 64
# one transaction stays well inside etcd's defaults (--max-txn-ops 128,
# --max-request-bytes 1.5 MiB); a generation that changes more is staged (commit_plan)
MAX_TXN_OPS = 100
MAX_TXN_BYTES = 1 << 20
MAX_PART_TRIMS = 32  # dead parts deleted per commit (the rest go with later ones)


@dataclass
class PlanCommit:
    """Everything one plan generation writes (tpflex_proto.planstore layout)."""

    job: str
    generation: int
    header: bytes  # encoded header Plan of this generation (split, stored_replicas)
    prev_plan_mod_revision: int  # 0 = the job has no plan yet
    parts: dict[int, bytes] = field(default_factory=dict)  # position -> part it changes
    all_parts: list[bytes] = field(default_factory=list)  # the generation's parts, in order
    # node -> (encoded NodePowerPlan, mod revision of power/<node> it replaces; 0 = none)
    power: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    event_seq: int = 0
    event_bytes: bytes = b""
    trim_event_seq: int = 0  # an event key to delete (the oldest beyond the bound); 0 = none
    trim_history_generation: int = 0  # a history generation to delete; 0 = none
    trim_parts: list[tuple[int, int]] = field(default_factory=list)  # dead (gen, position)
    clear_generations: list[int] = field(default_factory=list)  # stale staged parts to drop
    # nodes whose desired power is written in one transaction (a rack's: its caps never mix
    # two generations, so its budget holds); nodes in no group go one by one
    power_groups: list[list[str]] = field(default_factory=list)
    # set by commit_plan: node -> etcd revision its power key was written at
    power_revs: dict[str, int] = field(default_factory=dict)


@dataclass
class Planned:
    job: str
    result: PlanResult
    prev: PlanRecord | None
    cause: str
    detected_at: float
    planned_at: float
    by: str = ""  # the operator whose change caused this decision (a named REST token)
    note: str = ""  # what that change was: "drain n1:3 by alice: flaky NVLink"


def build_commit(
    view: ClusterView, p: Planned, *, history_size: int, encoder: PlanEncoder
) -> tuple[PlanCommit, dict[str, NodePower], types_pb2.Event]:
    generation = p.prev.generation + 1 if p.prev is not None else 1
    header, parts = encoder.split(p.result, generation, cause=p.cause, now=p.planned_at)
    if p.by:  # Plan.by (field 14) appended: the encoding of the merged message
        header += codec.encode(types_pb2.Plan(by=p.by))
    old = p.prev.parts if p.prev is not None else []
    # the encoder gives unchanged parts as the same objects (and says which it rebuilt)
    maybe = range(len(parts)) if len(old) != len(parts) else moved(old, parts)
    changed = {i: parts[i] for i in maybe if i >= len(old) or parts[i] != old[i]}
    index = view.plan_parts.get(p.job)
    oldest_kept = max(1, generation - history_size + 1)
    trims, stale = [], []
    if index is not None:
        stale = index.stale(generation - 1)
        # the last part of a position beyond a shrunk replica count stays until the job's
        # plan is retired (the view does not track the kept generations' counts)
        kept_count = max(len(parts), index.top_position() + 1)
        trims = [t for t in index.dead(oldest_kept, kept_count, MAX_PART_TRIMS) if t[0] not in stale]
    old = p.prev.decision() if p.prev is not None else None
    power = desired_power(view, old.power_caps if old is not None else {}, p.result.power_caps,
                          _cap_candidates(old, p.result))
    seq = view.next_event_seq()
    event = types_pb2.Event(
        seq=seq,
        at=p.planned_at,
        kind="plan_committed",
        job=p.job,
        generation=generation,
        cause=p.cause,
        by=p.by,
        reasons=([p.note] if p.note else []) + decision_reasons(old, p.result),
        phases=[
            types_pb2.PhaseTiming(phase="detected", at=p.detected_at),
            types_pb2.PhaseTiming(phase="committed", at=p.planned_at),
        ],
    )
    trim = view.event_seqs[0] if len(view.event_seqs) >= view.event_log_size else 0
    commit = PlanCommit(
        job=p.job,
        generation=generation,
        header=header,
        prev_plan_mod_revision=p.prev.mod_revision if p.prev is not None else 0,
        parts=changed,
        all_parts=parts,
        power={n: (encoder.power_wire(n, np.generation, np.caps), view.power.get(n, (None, 0))[1])
               for n, np in power.items()},
        event_seq=seq,
        event_bytes=codec.encode(event),
        trim_event_seq=trim,
        trim_history_generation=max(0, generation - history_size),
        trim_parts=trims,
        clear_generations=stale,
        power_groups=_by_rack(view, power),
    )
    return commit, power, event


def decision_reasons(old: PlanResult | None, new: PlanResult) -> list[str]:
    """``event_reasons(old.reasons, new.reasons)``; O(the replicas the planner planned
    again) where it says which (``model.changed_since``) and every line of theirs names
    its replica (``replica <i>: ...``, as the planner words them: a line of another
    replica can then equal none of theirs), and the plan's own lines (suspended pins,
    after the replicas') did not change; else over every line of both plans."""
    if old is None:
        return event_reasons(None, new.reasons)
    hint = changed_since(old, new)
    a, b = old.reason_parts, new.reason_parts
    if hint is None or a is None or b is None:
        return event_reasons(old.reasons, new.reasons)
    own_old = old.reasons[len(old.reasons) - len(old.suspended_pins):]
    own_new = new.reasons[len(new.reasons) - len(new.suspended_pins):]
    if own_old != own_new:
        return event_reasons(old.reasons, new.reasons)
    was: list[str] = []
    now: list[str] = []
    for i in hint:
        head = f"replica {i}:"
        lines_a, lines_b = a.get(i, ()), b.get(i, ())
        if not all(line.startswith(head) for line in chain(lines_a, lines_b)):
            return event_reasons(old.reasons, new.reasons)
        was.extend(lines_a)
        now.extend(lines_b)
    # the lines of the replicas not planned again are the same in both plans, and so are
    # the own lines: neither is new nor resolved, and none equals a line above
    return event_reasons([*was, *own_old], [*now, *own_new])


def event_reasons(old: tuple[str, ...] | None, new: tuple[str, ...]) -> list[str]:
    """What a decision's event says: the new plan's reasons that the previous plan did not
    have, then ``resolved: <reason>`` for each of the previous plan's that it no longer
    has (every reason of a job's first plan), at most ``MAX_EVENT_REASONS``. The plan
    itself lists every reason; an event that copied them all would grow with the failed
    GPUs of the whole job (64 lines, ~10 KB, in every commit at 262,144 GPUs)."""
    if old is None:
        return list(new[:MAX_EVENT_REASONS])
    had, has = set(old), set(new)
    out = [r for r in new if r not in had][:MAX_EVENT_REASONS]
    if len(out) < MAX_EVENT_REASONS:
        gone = (f"resolved: {r}" for r in old if r not in has)
        out.extend(islice(gone, MAX_EVENT_REASONS - len(out)))
    return out


def _by_rack(view: ClusterView, power) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for node in sorted(power):
        groups.setdefault(view.node_rack.get(node, ""), []).append(node)
    return list(groups.values())


def commit_plan(session: LeaderSession, c: PlanCommit) -> int:
    """Commit a plan generation by compare-and-swap on the header; returns the etcd
    revision of the transaction that made it visible (the header's).

    Its changed parts go first in the same transaction, or, when they would not fit in one
    (``MAX_TXN_OPS`` / ``MAX_TXN_BYTES``), in earlier fenced transactions under the new
    generation's number, which readers ignore until the header names it. Desired power that
    would not fit next to the header (one put and one compare per node: a generation that
    folds many changes) goes in earlier fenced transactions of whole ``power_groups``
    (racks), each compared with what it replaces; ``c.power_revs`` gets the revision of
    every node's write. Raises Conflict when the plan or a power key moved since it was
    read."""
    plan_key = keys.job_plan(c.job).encode()
    unchanged = (plan_key, c.prev_plan_mod_revision)
    tail: list = [(plan_key, c.header), (keys.job_plan_history(c.job, c.generation).encode(), c.header)]
    compare: list = [unchanged]
    # next to the header: its two puts, the event's put and two trims, the dead parts
    final, early = _power_batches(c.power, c.power_groups, room=MAX_TXN_OPS - len(tail) - 3 - len(c.trim_parts))
    for batch in early:
        rev = _fenced(session, [unchanged, *_power_compares(c, batch)], _power_puts(c, batch), c.job)
        c.power_revs.update(dict.fromkeys(batch, rev))
    power, power_key = c.power, keys.power
    for n in final:
        key, (value, revision) = power_key(n).encode(), power[n]
        compare.append((key, revision))
        tail.append((key, value))
    if c.event_seq:
        tail.append((keys.event(c.event_seq).encode(), c.event_bytes))
    if c.trim_event_seq:
        tail.append(Op.delete(keys.event(c.trim_event_seq)))
    if c.trim_history_generation:
        tail.append(Op.delete(keys.job_plan_history(c.job, c.trim_history_generation)))
    tail.extend(Op.delete(keys.job_assign(c.job, g, i)) for g, i in c.trim_parts)
    parts = [(keys.job_assign(c.job, c.generation, i).encode(), v) for i, v in sorted(c.parts.items())]
    clear = [*c.clear_generations]
    fit = fits([*parts, *tail])
    if not fit:
        clear.append(c.generation)
    for gen in sorted(set(clear)):
        _fenced(session, [unchanged], [Op.delete_prefix(keys.job_assigns_of(c.job, gen))], c.job)
    if c.generation not in clear:
        compare.append(Cmp.prefix_absent(keys.job_assigns_of(c.job, c.generation)))
    while parts and not fit:
        chunk = _chunk(parts)
        _fenced(session, [unchanged], chunk, c.job)
        parts = parts[len(chunk):]
        fit = fits([*parts, *tail])
    rev = _fenced(session, compare, [*parts, *tail], c.job)
    c.power_revs.update(dict.fromkeys(final, rev))
    return rev


def _power_batches(power, power_groups: list[list[str]], room: int) -> tuple[list[str], list[list[str]]]:
    """The nodes of ``power`` whose write goes with the header (as many whole groups as
    ``room`` holds), and the batches of whole groups written before it (at most half the
    op limit each, a group larger than that alone)."""
    grouped = {n for g in power_groups for n in g}
    groups = [[n for n in g if n in power] for g in power_groups]
    groups = [g for g in groups if g] + [[n] for n in sorted(power) if n not in grouped]
    final: list[str] = []
    early: list[list[str]] = []
    for g in groups:
        if len(final) + len(g) <= room and not early:
            final += g
        elif early and len(early[-1]) + len(g) <= MAX_TXN_OPS // 2:
            early[-1] += g
        else:
            early.append(list(g))
    return final, early


def _power_compares(c, nodes: list[str]) -> list[tuple[bytes, int]]:
    return [(keys.power(n).encode(), c.power[n][1]) for n in nodes]


def _power_puts(c, nodes: list[str]) -> list[tuple[bytes, bytes]]:
    return [(keys.power(n).encode(), c.power[n][0]) for n in nodes]


# The transactions here hold compares and operations in two forms: a plain tuple is a
# mod-revision compare ``(key, revision)`` or a put ``(key, value)``, written into the
# request in place (``_fenced``); anything else is a Compare or RequestOp message.

# the most bytes a put's tags and length varints add to its key and value (three of each,
# a length below 2**35 in at most five bytes)
_PUT_OVERHEAD = 18


def put_size(key: bytes, value: bytes) -> int:
    """The bytes of ``Op.put(key, value)`` (a RequestOp holding a PutRequest)."""
    k, v = len(key), len(value)
    body = (1 + _varint_len(k) + k if k else 0) + (1 + _varint_len(v) + v if v else 0)
    return 1 + _varint_len(body) + body


def _op_size(op) -> int:
    return put_size(*op) if type(op) is tuple else op.ByteSize()


def fits(ops: list) -> bool:
    """Whether ``ops`` go in one transaction (``MAX_TXN_OPS``, ``MAX_TXN_BYTES``): by an
    upper bound of the puts' sizes first, exactly only where the bound is too much."""
    if len(ops) > MAX_TXN_OPS:
        return False
    bound = 0
    for op in ops:
        bound += len(op[0]) + len(op[1]) + _PUT_OVERHEAD if type(op) is tuple else op.ByteSize()
    return bound <= MAX_TXN_BYTES or sum(map(_op_size, ops)) <= MAX_TXN_BYTES


def _chunk(ops: list) -> list:
    size, n = 0, 0
    for op in ops[:MAX_TXN_OPS // 2]:
        size += _op_size(op)
        if n and size > MAX_TXN_BYTES // 2:
            break
        n += 1
    return ops[:max(n, 1)]


def _fenced(session: LeaderSession, compare: list, ops: list, job: str) -> int:
    txn = TxnBuilder()
    txn.mod_revisions_are([cmp for cmp in compare if type(cmp) is tuple])
    for cmp in compare:
        if type(cmp) is not tuple:
            txn.compare(cmp)
    txn.ops(ops)
    res = session.txn_request(txn)
    if not res.succeeded:
        raise Conflict(f"plan of job {job} or its power keys changed since read")
    return res.revision


def _cap_candidates(old: PlanResult | None, new: PlanResult) -> set[GpuKey] | None:
    """The GPUs of the cap parts that differ between two plans (None: unknown)."""
    changed = changed_cap_parts(old, new) if old is not None else None
    if changed is None:
        return None
    out: set[GpuKey] = set()
    for i in changed:
        for part in (old.cap_parts.get(i), new.cap_parts.get(i)):
            if part:
                out.update(part)
    return out


def desired_power(
    view: ClusterView, old_caps, new_caps, candidates: set[GpuKey] | None = None
) -> dict[str, NodePower]:
    """The new desired power plan of every node whose caps change.

    Candidates are the nodes of GPUs whose cap differs between the old and the new plan
    (among ``candidates`` when given: a superset of them, such as the GPUs of the changed
    cap parts); a candidate's desired caps (every GPU of the node: the plan's cap or the
    rack's TDP) are compared with what ``power/<node>`` holds now (all TDP when absent),
    so a repeated pass writes nothing. O(changed GPUs) with ``candidates``.
    """
    out: dict[str, NodePower] = {}
    if candidates is not None:
        gpus = list(candidates)
        now = dict(zip(gpus, _caps_of(new_caps, gpus), strict=True))
        changed = {g for g, was in zip(gpus, _caps_of(old_caps, gpus), strict=True) if was != now[g]}
    else:
        now = {}
        changed = {g for g, w in new_caps.items() if old_caps.get(g) != w}
        changed.update(g for g in old_caps if g not in new_caps)
    node_rack, power, racks = view.node_rack, view.power, {}  # rack name -> (TDP, indices)
    for node in sorted({g[0] for g in changed}):
        name = node_rack.get(node)
        rack = racks.get(name)
        if rack is None:
            info = view.racks.get(name) if name is not None else None
            if info is None:
                continue
            rack = racks[name] = (float(info.tdp_w), view.node_gpu_indices(node))
        tdp, indices = rack
        want = []
        boosted = False
        for i in indices:
            w = now.get((node, i), _UNKNOWN)
            if w is _UNKNOWN:  # not a candidate: its cap did not change
                w = new_caps.get((node, i))
            if w is None:
                want.append((i, tdp))
            else:
                want.append((i, float(w)))
                boosted = boosted or w != tdp
        want = tuple(want)
        current = power.get(node)
        if current is not None:
            if current[0].caps == want or dict(current[0].caps) == dict(want):
                continue
        elif not boosted:
            continue
        out[node] = NodePower(current[0].generation + 1 if current is not None else 1, want)
    return out


_UNKNOWN = object()


def _caps_of(caps, gpus: list[GpuKey]) -> list[float | None]:
    """Each GPU's cap in ``caps`` (None: none), in one call (planner.caps.MergedCaps
    inlines the look-up; a dict's is in C)."""
    many = getattr(caps, "get_many", None)
    return many(gpus) if many is not None else list(map(caps.get, gpus))


def changed_degrees(p: Planned) -> list[tuple[int, int]]:
    """(replica, degree) of the replicas whose degree the new plan changes (all of them
    when there is no previous decision to compare with)."""
    new = p.result.replicas
    old = p.prev.result.replicas if p.prev is not None and p.prev.result is not None else None
    if old is None or len(old) != len(new):
        return [(r.index, r.tp_degree) for r in new]
    return [
        (r.index, r.tp_degree)
        for r, o in ((new[i], old[i]) for i in moved(old, new))
        if r.tp_degree != o.tp_degree
    ]


def rank_count(result: PlanResult) -> int:
    """The ranks a plan runs (GPUs over every stage of every replica), counted in C."""
    stages = chain.from_iterable(map(_stages_of, result.replicas))
    return sum(map(len, map(_gpus_of, stages)))


def rank_count_since(old: PlanResult, old_count: int, new: PlanResult) -> int:
    """``rank_count(new)`` from ``rank_count(old) == old_count``: O(replicas that are not
    the same objects), compared in C."""
    a, b = old.replicas, new.replicas
    if len(a) != len(b):
        return rank_count(new)
    for i in moved(a, b):
        old_count += _ranks_of(b[i]) - _ranks_of(a[i])
    return old_count


def _ranks_of(r) -> int:
    return sum(len(s.gpus) for s in r.stages)


_stages_of = attrgetter("stages")
_gpus_of = attrgetter("gpus")


def pin_events(p: Planned, generation: int, at: float) -> list[types_pb2.Event]:
    """``pin_suspended`` / ``pin_resumed`` events for the pins whose state the new plan
    changes (none when it changes none)."""
    out = []
    for kind, pins in pin_changes(p).items():
        if pins:
            what = "suspended" if kind == "pin_suspended" else "holds again, was suspended"
            reasons = [f"replica {x.replica}: TP pin {x.tp_degree} {what}: {x.reason}" for x in pins]
            out.append(types_pb2.Event(at=at, kind=kind, job=p.job, generation=generation,
                                       cause=p.cause, reasons=reasons, by=p.by))
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


@dataclass
class RetireCommit:
    """What removing a deleted job's plan writes: the plan and its history go, and the
    nodes whose caps the plan set go back to their TDP."""

    job: str
    plan_mod_revision: int
    power: dict[str, tuple[bytes, int]]  # node -> (encoded NodePowerPlan, revision it replaces)
    power_groups: list[list[str]]  # as PlanCommit's
    power_revs: dict[str, int] = field(default_factory=dict)  # set by commit_retire


def build_retire(view: ClusterView, job: str) -> tuple[RetireCommit, dict[str, NodePower]] | None:
    """The retirement of a deleted job's plan (None when it has none) and the nodes' new
    desired power."""
    rec = view.plans.get(job)
    if rec is None:
        return None
    power = desired_power(view, rec.decision().power_caps, {})
    encoded = {n: (np.wire(n), view.power.get(n, (None, 0))[1]) for n, np in power.items()}
    return RetireCommit(job, rec.mod_revision, encoded, _by_rack(view, power)), power


def commit_retire(session: LeaderSession, c: RetireCommit) -> int:
    """Delete the plan by compare-and-swap, its nodes' caps back to TDP; power that would
    not fit next to the deletes goes first, in fenced transactions of whole racks (as in
    ``commit_plan``). Returns the deletes' revision; raises Conflict."""
    unchanged = (keys.job_plan(c.job).encode(), c.plan_mod_revision)
    ops = [Op.delete(keys.job_plan(c.job)), Op.delete_prefix(keys.job_plan_histories(c.job)),
           Op.delete_prefix(keys.job_assigns(c.job))]
    final, early = _power_batches(c.power, c.power_groups, room=MAX_TXN_OPS - len(ops))
    for batch in early:
        rev = _fenced(session, [unchanged, *_power_compares(c, batch)], _power_puts(c, batch), c.job)
        c.power_revs.update(dict.fromkeys(batch, rev))
    rev = _fenced(session, [unchanged, *_power_compares(c, final)], [*ops, *_power_puts(c, final)], c.job)
    c.power_revs.update(dict.fromkeys(final, rev))
    return rev
