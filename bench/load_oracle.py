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
write before its commit; it passes when one of those states satisfies every rule."""

from __future__ import annotations

from collections.abc import Iterable

from tpflex_proto import types_pb2

Failed = dict[str, frozenset[int]]  # node -> failed GPU indices


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
        mine = sorted([(e[0], e[2], frozenset(e[3])) for e in events if self.node_rack[e[2]] in self.job_racks[job]]
                      + [(rev, n, None) for rev, n in losses if self.node_rack[n] in self.job_racks[job]],
                      key=lambda e: e[0])
        states: list[Failed] = [{}]
        lost: set[str] = set()
        for _, node, failed in mine:
            if failed is None or node in lost:  # lost: no GPU of the node usable, for good
                lost.add(node)
                failed = frozenset(range(self.racks[self.node_rack[node]].gpus_per_node))
            states.append({**states[-1], node: failed})
        out: list[str] = []
        lower = upper = 0
        expect_gen = plans[0][2].generation if plans else 1
        for rev, _, plan in plans:
            if plan.generation != expect_gen:
                out.append(f"job {job}: generation {plan.generation} after {expect_gen - 1}")
            expect_gen = plan.generation + 1
            while upper < len(mine) and mine[upper][0] < rev:
                upper += 1
            ok = next((k for k in range(upper, lower - 1, -1) if not self.violations(job, plan, states[k])), None)
            if ok is None:
                out += [f"job {job} generation {plan.generation}: {v}"
                        for v in self.violations(job, plan, states[upper])[:3]]
            else:
                lower = ok
        return out
