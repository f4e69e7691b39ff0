"""The load benchmark's invariant oracle: checks every committed plan against rules it
computes itself from the raw inputs (rack and job protobufs, the failures written), with
no planner code:

- no failed GPU in any plan (a plan may lag the cluster, so a GPU counts as failed for a
  plan only if it was failed in every state the plan can have been decided on);
- each stage's degree equals its usable GPUs, capped by the smallest unit count, and the
  stage uses exactly that many distinct GPUs of its rack;
- caps within the GPU's limits [min_w, max_w], and the sum over a rack's usable GPUs
  (TDP for the uncapped) within the rack's budget;
- generations contiguous: each job's plans arrive as 1, 2, 3, ... with no gap.

A node whose registration or health record was deleted (its lease lapsed or was revoked)
is lost from that revision on: none of its GPUs is usable (``losses``).

A plan may reflect any state from the one its predecessor reflected up to the last health
write before its commit; it passes when one of those states satisfies every rule. The
controller's view only moves forward, so the states the plans reflect must not decrease;
of the states a plan passes on, the earliest is taken as the one it reflects (``follow``):
a later one would wrongly rule out states a lagging controller really planned on next
(a GPU failed and recovered again while a plan was being made: the plan passes on the
states before and after both, the next plan may reflect the failure).

``job_states`` and ``follow`` are shared with the planner check (``bench/load.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from tpflex_proto import types_pb2

Failed = dict[str, frozenset[int]]  # node -> failed GPU indices


class JobState(NamedTuple):
    """One state of a job's inputs: what the controller could have planned on."""

    revision: int  # of the write that made it (0: the start of the run)
    failed: Failed  # the health records as last written (a lost node keeps its last one)
    lost: frozenset[str]  # nodes whose keys were deleted (lease lapsed or revoked)


def job_states(events, losses, in_job: Callable[[str], bool]) -> list[JobState]:
    """The states a job's inputs passed through, in revision order, from the run's health
    writes ``events`` (revision, t, node, failed set, ...) and node ``losses`` (revision,
    node) of the nodes ``in_job`` says matter; ``[0]`` is the start (all healthy)."""
    writes = sorted([(e[0], e[2], frozenset(e[3])) for e in events if in_job(e[2])]
                    + [(rev, n, None) for rev, n in losses if in_job(n)], key=lambda w: w[0])
    out = [JobState(0, {}, frozenset())]
    for rev, node, failed in writes:
        last = out[-1]
        if node in last.lost:
            continue  # gone for good: nothing of it counts again
        if failed is None:
            out.append(JobState(rev, last.failed, last.lost | {node}))
        else:
            out.append(JobState(rev, {**last.failed, node: failed}, last.lost))
    return out


class Judged(NamedTuple):
    revision: int  # the plan's commit revision
    plan: object
    lower: int  # the states the plan may reflect: states[lower..upper]
    upper: int
    match: int | None  # the earliest of them it passes on; None: none


def follow(plans, states: list[JobState], passes: Callable[[object, int], bool]) -> Iterator[Judged]:
    """Judge a job's plans ``(revision, arrival, plan)``, in commit order, against
    ``states``: plan i may reflect a state written before its commit and not before the
    one plan i-1 reflected; ``passes(plan, k)`` says whether it is right on state k. The
    earliest such k is taken (the choice that leaves the later plans the most room)."""
    lower = upper = 0
    for rev, _, plan in plans:
        while upper + 1 < len(states) and states[upper + 1].revision < rev:
            upper += 1
        match = next((k for k in range(lower, upper + 1) if passes(plan, k)), None)
        yield Judged(rev, plan, lower, upper, match)
        if match is not None:
            lower = match


class InvariantOracle:
    def __init__(self, racks: Iterable[types_pb2.Rack], jobs: dict[str, types_pb2.JobSpec]) -> None:
        self.racks = {r.name: r for r in racks}
        self.node_rack = {n: r.name for r in self.racks.values() for n in r.nodes}
        self.full = {name: min([spec.base_tp, *(u.count for u in spec.units)]) for name, spec in jobs.items()}
        self.jobs = jobs
        self.job_racks = {name: {st.rack for rep in spec.replicas for st in rep.stages}
                          for name, spec in jobs.items()}

    def violations(self, job: str, plan: types_pb2.Plan, failed: Failed) -> list[str]:
        """What ``plan`` breaks on the cluster state ``failed`` (empty: nothing)."""
        out: list[str] = []
        spec = self.jobs[job]
        for rep in plan.replicas:
            for st in rep.stages:
                out += self._stage(spec, rep.index, st, failed, self.full[job])
        out += self._power(plan, failed)
        return out

    def _stage(self, spec, index: int, st, failed: Failed, full: int) -> list[str]:
        rack = self.racks[st.rack]
        gpus = [(g.node, g.index) for g in st.gpus]
        bad = [g for g in gpus if g[1] in failed.get(g[0], ())]
        out = [f"replica {index}: failed GPU {g} in the plan" for g in bad]
        if len(set(gpus)) != len(gpus) or st.tp_degree != len(gpus):
            out.append(f"replica {index}: degree {st.tp_degree} with {len(set(gpus))} distinct GPUs")
        if any(g[0] not in rack.nodes for g in gpus):
            out.append(f"replica {index}: a GPU outside rack {st.rack}")
        spec_rack = spec.replicas[index].stages[st.spec_stage].rack
        if st.rack == spec_rack:
            usable = sum(rack.gpus_per_node - len(failed.get(n, ())) for n in rack.nodes)
            if st.tp_degree != min(usable, full):
                out.append(f"replica {index}: degree {st.tp_degree}, usable GPUs {usable} (cap {full})")
        return out

    def _power(self, plan: types_pb2.Plan, failed: Failed) -> list[str]:
        out: list[str] = []
        caps: dict[str, dict[tuple[str, int], float]] = {}
        for c in plan.power_caps:
            rack = self.racks[self.node_rack[c.gpu.node]]
            if not rack.gpu_min_w <= c.cap_w <= rack.gpu_max_w:
                out.append(f"cap {c.cap_w} W of {c.gpu.node}:{c.gpu.index} outside the GPU's limits")
            caps.setdefault(rack.name, {})[(c.gpu.node, c.gpu.index)] = c.cap_w
        for name, rack_caps in caps.items():
            rack = self.racks[name]
            total = sum(
                rack_caps.get((n, i), rack.gpu_tdp_w)
                for n in rack.nodes for i in range(rack.gpus_per_node) if i not in failed.get(n, ())
            )
            if total > rack.power_budget_w + 1e-6:
                out.append(f"rack {name}: caps sum {total:.0f} W above budget {rack.power_budget_w:.0f} W")
        return out

    def check(self, job: str, plans, events, losses=()) -> list[str]:
        """Violations of one job's plan sequence; ``plans`` (revision, arrival, Plan) in
        order, ``events`` (revision, t, node, failed set, is_failure, ...) of the whole run,
        ``losses`` (revision, node) of the nodes lost (keys deleted), in revision order."""
        states = job_states(events, losses, lambda n: self.node_rack[n] in self.job_racks[job])
        failed = [self._unusable(st) for st in states]
        out: list[str] = []
        expect_gen = plans[0][2].generation if plans else 1
        for plan in (p for _, _, p in plans):
            if plan.generation != expect_gen:
                out.append(f"job {job}: generation {plan.generation} after {expect_gen - 1}")
            expect_gen = plan.generation + 1
        for j in follow(plans, states, lambda plan, k: not self.violations(job, plan, failed[k])):
            if j.match is not None:
                continue
            # on the candidate state it breaks the fewest rules on
            worst = min(range(j.lower, j.upper + 1), key=lambda k: len(self.violations(job, j.plan, failed[k])))
            where = (f"(commit revision {j.revision}, inputs {j.lower}..{j.upper} at revisions "
                     f"{states[j.lower].revision}..{states[j.upper].revision}, judged on {worst})")
            out += [f"job {job} generation {j.plan.generation}: {v} {where}"
                    for v in self.violations(job, j.plan, failed[worst])[:3]]
        return out

    def _unusable(self, st: JobState) -> Failed:
        """Failed GPUs, a lost node's all of them."""
        if not st.lost:
            return st.failed
        return {**st.failed, **{n: frozenset(range(self.racks[self.node_rack[n]].gpus_per_node)) for n in st.lost}}
