"""Incremental re-planning equals the whole-job plan (hypothesis, random event sequences),
and re-plans only the replicas a change touches."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.planner import (
    ClusterState,
    GpuStatus,
    JobSpec,
    Policy,
    RackInfo,
    ReplicaSpec,
    StageSpec,
    plan,
)
from tpflex_controller.planner.incremental import Changes, plan_job, replan
from tpflex_controller.planner.model import JobOverrides, moved

from tests.controller.planner_fixtures import make_job, make_rack, make_racks

EVENTS = ["fail", "repair", "drain", "undrain", "slow", "node_down", "node_up",
          "power_pin", "unpin_power", "tp_pin", "unpin_tp", "budget", "policy"]


class World:
    """A mutable cluster the events change; ``state()`` is a fresh, frozen copy."""

    def __init__(self, racks: dict[str, RackInfo]) -> None:
        self.racks = dict(racks)
        self.status: dict = {}
        self.speed: dict = {}
        self.pins: dict = {}
        self.nodes = sorted({g[0] for r in racks.values() for g in r.gpus})
        self.dead: set[str] = set()
        self.tp_pins: dict[int, int] = {}
        self.policy: Policy | None = None

    def state(self) -> ClusterState:
        live = frozenset(self.nodes) - self.dead
        return ClusterState(dict(self.racks), dict(self.status), dict(self.speed), live, dict(self.pins))

    def overrides(self) -> JobOverrides:
        return JobOverrides(pins=dict(self.tp_pins), policy=self.policy)


def _shared_job(racks: dict[str, RackInfo], tp: int, stages: int, replicas: int, order, spares,
                min_tp: int) -> JobSpec:
    """Stages placed on random halves of racks of 2 x tp GPUs: replicas share rack budgets."""
    slots = [(name, r.gpus[h * tp:(h + 1) * tp]) for name, r in racks.items() if name not in spares for h in (0, 1)]
    slots = [slots[i] for i in order][: replicas * stages]
    reps = tuple(
        ReplicaSpec(tuple(StageSpec(*slots[r * stages + s]) for s in range(stages))) for r in range(replicas)
    )
    return JobSpec("job", tp, reps, {"heads": 64, "ffn": 128}, min_tp=min_tp, local_batch=8,
                   spare_racks=tuple(spares))


@st.composite
def worlds(draw):
    tp = draw(st.integers(2, 3))
    stages = draw(st.integers(1, 2))
    replicas = draw(st.integers(2, 5))
    n_spares = draw(st.integers(0, 2))
    headroom = draw(st.sampled_from([-0.15, -0.05, 0.05, 0.3]))
    if draw(st.booleans()):  # replicas share racks (2 stages per rack)
        n_racks = (replicas * stages + 1) // 2
        racks = {f"r{i}": make_rack(f"r{i}", 2 * tp, headroom=headroom) for i in range(n_racks)}
        spares = [f"s{i}" for i in range(n_spares)]
        racks.update({s: make_rack(s, 2 * tp, headroom=headroom) for s in spares})
        order = draw(st.permutations(range(2 * n_racks)))
        job = _shared_job(racks, tp, stages, replicas, order, spares, draw(st.integers(1, tp)))
    else:
        racks = make_racks(replicas * stages + n_spares, tp, headroom=headroom)
        spares = tuple(list(racks)[replicas * stages:])
        # heads < tp: in-rack spares (the replica's full degree T is below base_tp)
        heads = draw(st.sampled_from([64, 64, tp - 1]))
        job = make_job(racks, tp, stages, min_tp=draw(st.integers(1, tp)), spares=spares,
                       units={"heads": heads, "ffn": 128})
    policy = draw(st.sampled_from(list(Policy)))
    return World(racks), job, policy


def _apply(world: World, job: JobSpec, draw) -> Changes:
    kind = draw(st.sampled_from(EVENTS))
    gpus = [g for r in world.racks.values() for g in r.gpus]
    gpu = draw(st.sampled_from(gpus))
    node = gpu[0]
    if kind == "fail":
        world.status[gpu] = GpuStatus.FAILED
    elif kind == "repair":
        world.status.pop(gpu, None)
        world.speed.pop(gpu, None)
    elif kind == "drain":
        world.status[gpu] = GpuStatus.DRAINED
    elif kind == "undrain" and world.status.get(gpu) is GpuStatus.DRAINED:
        del world.status[gpu]
    elif kind == "slow":
        world.status[gpu] = GpuStatus.DEGRADED
        world.speed[gpu] = draw(st.sampled_from([0.6, 0.8, 0.95]))
    elif kind == "node_down":
        world.dead.add(node)
    elif kind == "node_up":
        world.dead.discard(node)
    elif kind == "power_pin":
        world.pins[gpu] = draw(st.sampled_from([300.0, 650.0, 800.0, 5000.0]))
    elif kind == "unpin_power":
        world.pins.pop(gpu, None)
    elif kind == "tp_pin":
        world.tp_pins[draw(st.integers(0, len(job.replicas)))] = draw(st.integers(0, job.base_tp + 1))
    elif kind == "unpin_tp" and world.tp_pins:
        world.tp_pins.pop(draw(st.sampled_from(sorted(world.tp_pins))))
    elif kind == "budget":
        name = draw(st.sampled_from(sorted(world.racks)))
        r = world.racks[name]
        world.racks[name] = dataclasses.replace(r, power_budget_w=r.tdp_w * len(r.gpus) * draw(
            st.sampled_from([0.9, 1.0, 1.1, 1.3])))
        return Changes(racks=frozenset({name}))
    elif kind == "policy":
        world.policy = draw(st.sampled_from([None, *Policy]))
    return Changes(nodes=frozenset({node}))


@settings(max_examples=250, deadline=None)
@given(worlds(), st.data())
def test_incremental_equals_whole_job_plan(world_job, data):
    world, job, policy = world_job
    state = world.state()
    prev = plan_job(state, job, overrides=world.overrides())
    assert prev.result == plan(state, job, overrides=world.overrides())
    for _ in range(data.draw(st.integers(1, 25))):
        changes = _apply(world, job, data.draw)
        if data.draw(st.booleans()):  # several events folded before one re-plan
            more = _apply(world, job, data.draw)
            changes = Changes(changes.nodes | more.nodes, changes.racks | more.racks)
        state, over = world.state(), world.overrides()
        job_policy = policy if world.policy is None and policy is not job.policy else None
        before = prev.result.replicas
        prev = replan(prev, state, job, changes, policy=job_policy, overrides=over)
        after = prev.result.replicas
        if len(before) == len(after):  # what the planner tells ``moved`` covers every change
            differ = {i for i in range(len(after)) if before[i] is not after[i]}
            assert differ <= set(moved(before, after))
        whole = plan(state, job, policy=job_policy, overrides=over)
        assert prev.result == whole
        # the reasons by replica (stored with each replica's part) too, and they make up
        # the reasons in replica order, before the plan's own
        assert dict(prev.result.reason_parts) == dict(whole.reason_parts)
        said = [line for i in sorted(whole.reason_parts) for line in whole.reason_parts[i]]
        assert list(whole.reasons[:len(said)]) == said
        assert all(line.startswith(f"replica {i}:") for i, lines in whole.reason_parts.items() for line in lines)


def test_one_failure_replans_one_replica():
    racks = make_racks(64, 8)
    job = make_job(racks, 8)
    world = World(racks)
    prev = plan_job(world.state(), job)
    assert prev.replanned == 64
    world.status[("r17-n1", 0)] = GpuStatus.FAILED
    nxt = replan(prev, world.state(), job, Changes(nodes=frozenset({"r17-n1"})))
    assert nxt.replanned == 1
    assert nxt.result == plan(world.state(), job)
    assert nxt.result.replicas[17].tp_degree == 7
    assert nxt.result.replicas[16] is prev.result.replicas[16]  # copied, not rebuilt


def test_unknown_changes_or_new_spec_replan_the_whole_job():
    racks = make_racks(4, 4)
    job = make_job(racks, 4)
    world = World(racks)
    prev = plan_job(world.state(), job)
    assert replan(prev, world.state(), job, None).replanned == 4
    other = dataclasses.replace(job)
    assert replan(prev, world.state(), other, Changes()).replanned == 4


def test_a_pin_replans_the_replica_sharing_its_rack_budget():
    """Two degraded replicas boosted on one rack whose budget runs short: pinning one
    lower frees power for the other, which is planned again although nothing of it moved."""
    x = make_rack("X", 8, headroom=-0.1)
    job = JobSpec("job", 4, (ReplicaSpec((StageSpec("X", x.gpus[:4]),)),
                             ReplicaSpec((StageSpec("X", x.gpus[4:]),))), {"heads": 64}, local_batch=8)
    world = World({"X": x})
    world.status.update({x.gpus[0]: GpuStatus.FAILED, x.gpus[4]: GpuStatus.FAILED})
    prev = plan_job(world.state(), job)
    world.tp_pins[1] = 2
    nxt = replan(prev, world.state(), job, Changes(), overrides=world.overrides())
    assert nxt.result == plan(world.state(), job, overrides=world.overrides())
    assert nxt.replanned == 2
    a_gpu = x.gpus[1]
    assert nxt.result.power_caps[a_gpu] > prev.result.power_caps[a_gpu]  # replica 0 got more
