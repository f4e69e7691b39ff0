"""Plan storage that scales with the change (tpflex_proto.planstore): the stored header
and parts assemble to exactly the whole plan's encoding, a generation writes only the
parts it changes, and a generation too big for one transaction is staged (etcd runs with
its default request limit in the tests)."""

from __future__ import annotations

import pytest
from tpflex_controller import convert
from tpflex_controller.planbytes import PlanEncoder
from tpflex_controller.planner import Policy, plan
from tpflex_controller.planner.model import moved
from tpflex_controller.planning import PlanCommit, commit_plan
from tpflex_proto import codec, keys, planstore

from tests.controller.planner_fixtures import failed, make_job, make_racks, state
from tests.controller.test_election import _campaign


def test_header_and_parts_assemble_to_the_whole_plan_encoding():
    racks = make_racks(6, size=8)
    job = make_job(racks, tp=8, units={"heads": 64, "ffn": 128, "vocab": 64})
    gpus = [g for r in racks.values() for g in r.gpus]
    encoder = PlanEncoder()
    for gen, down in enumerate(([], [gpus[3]], [gpus[3], gpus[12], gpus[13]], [gpus[12]]), start=1):
        result = plan(state(racks, gpu_status=failed(*down)), job)
        header, parts = encoder.split(result, gen, cause="t", now=5.0)
        reference = codec.encode(convert.plan_to_proto(result, gen, cause="t", now=5.0))
        assert planstore.Assembler().whole(header, parts) == reference
        assert len(parts) == len(result.replicas)
        if down:
            assert result.power_caps  # the degraded replica is boosted: caps ride in parts
        decoded = planstore.decode_plan(header, "h")
        assert decoded.split and decoded.stored_replicas == len(parts) and not decoded.replicas


def test_big_generation_is_staged_and_the_next_writes_only_its_change(etcd):
    s = _campaign(etcd, "leader", ttl=30)
    # 400 replicas of 8 KiB: 3.2 MB, twice etcd's default request limit
    parts = [codec.encode(_replica_plan(i)) for i in range(400)]
    header1 = codec.encode(_header(1, len(parts)))
    rev = commit_plan(s, PlanCommit("j", 1, header1, 0, parts=dict(enumerate(parts))))
    whole1, history = planstore.read_job(etcd, "j")
    assert [r.index for r in whole1.replicas] == list(range(400)) and whole1.generation == 1
    assert not whole1.split and len(history) == 1

    changed = codec.encode(_replica_plan(7, tp=3))
    before, _ = etcd.get_prefix(keys.job_assigns("j"), keys_only=True)
    commit_plan(s, PlanCommit("j", 2, codec.encode(_header(2, 400)), rev, parts={7: changed}))
    after, _ = etcd.get_prefix(keys.job_assigns("j"), keys_only=True)
    assert {kv.key for kv in after} - {kv.key for kv in before} == {keys.job_assign("j", 2, 7)}
    whole2, history = planstore.read_job(etcd, "j")
    assert whole2.replicas[7].tp_degree == 3 and whole2.replicas[6] == whole1.replicas[6]
    assert [p.generation for p in history] == [1, 2] and history[0] == whole1  # history likewise

    watcher = planstore.JobPlans("j")
    kvs, _ = etcd.get_prefix(keys.job_prefix("j"))
    assert watcher.fold_read(kvs) == whole2


def _replica_plan(i: int, tp: int = 8):
    from tpflex_proto import types_pb2

    holder = types_pb2.Plan()
    holder.replicas.add(index=i, tp_degree=tp, reason="x" * 8192)
    return holder


def _header(gen: int, n: int):
    from tpflex_proto import types_pb2

    return types_pb2.Plan(job="j", generation=gen, policy="ntp-pw", split=True, stored_replicas=n)


@pytest.mark.parametrize("policy", [Policy.NTP_PW, Policy.SPARE])
def test_parts_from_cap_parts_equal_parts_placed_per_gpu_through_replans(policy):
    """The encoder builds parts from the planner's cap parts and reuses the last split's
    where neither the replica nor its caps changed; the parts equal the ones placed GPU
    by GPU (a result without cap parts) and assemble to the whole plan's encoding. Under
    ``spare`` replicas hand spare racks to each other between generations."""
    import dataclasses
    import random

    from tpflex_controller.planner.incremental import Changes, replan

    racks = make_racks(8, size=8)
    spares = ("r6", "r7") if policy is Policy.SPARE else ()
    job = make_job(racks, tp=8, units={"heads": 64, "ffn": 128, "vocab": 64}, spares=spares)
    job = dataclasses.replace(job, policy=policy)
    gpus = [g for r in racks.values() for g in r.gpus]
    rng = random.Random(5)
    fast, slow = PlanEncoder(), PlanEncoder()
    last_parts: list = []
    down: set = set()
    jp = None
    for gen in range(1, 25):
        changed = set(rng.sample(gpus, rng.randrange(1, 4)))
        down ^= changed
        cluster = state(racks, gpu_status=failed(*sorted(down)))
        jp = replan(jp, cluster, job, Changes(nodes=frozenset(g[0] for g in changed)))
        result = jp.result
        assert result.cap_parts is not None
        header, parts = fast.split(result, gen, cause="t", now=5.0)
        if gen > 1 and len(parts) == len(last_parts):  # what the encoder tells ``moved``
            differ = {i for i in range(len(parts)) if parts[i] is not last_parts[i]}
            assert differ <= set(moved(last_parts, parts))
        last_parts = parts
        per_gpu = slow.split(dataclasses.replace(result, cap_parts=None), gen, cause="t", now=5.0)
        assert (header, parts) == per_gpu
        reference = codec.encode(convert.plan_to_proto(result, gen, cause="t", now=5.0))
        assert planstore.Assembler().whole(header, parts) == reference
    if not result.cap_parts:
        return
    # a cap part that changes while its replica stays the same object is rebuilt too
    i = next(iter(result.cap_parts))
    g = next(iter(result.cap_parts[i]))
    altered = dataclasses.replace(
        result,
        power_caps={**result.power_caps, g: 1234.0},
        cap_parts={**result.cap_parts, i: {**result.cap_parts[i], g: 1234.0}},
    )
    got = fast.split(altered, 25, cause="t", now=5.0)
    assert got == slow.split(dataclasses.replace(altered, cap_parts=None), 25, cause="t", now=5.0)


def test_a_generation_that_changes_many_nodes_power_commits_within_etcds_op_limit(etcd):
    """Issue 14: a lagging controller folds many failures into one generation; its power
    writes alone (one put and one compare per node) went past etcd's --max-txn-ops (128,
    the test etcd's default too) and the commit failed on every retry. Whole racks are
    written together, ahead of the header, and their revisions are reported."""
    from tpflex_proto import types_pb2

    s = _campaign(etcd, "leader", ttl=30)
    racks = {f"r{r}": [f"r{r}-n{i:02d}" for i in range(18)] for r in range(12)}  # 216 nodes
    power = {}
    for nodes in racks.values():
        for n in nodes:
            np = types_pb2.NodePowerPlan(node=n, generation=1, caps=[
                types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=n, index=i), cap_w=1028.0) for i in range(4)])
            power[n] = (codec.encode(np), 0)
    c = PlanCommit("j", 1, codec.encode(_header(1, 1)), 0, parts={0: codec.encode(_replica_plan(0))},
                   power=power, power_groups=list(racks.values()))
    rev = commit_plan(s, c)
    assert etcd.get(keys.job_plan("j")).mod_revision == rev
    stored = {n: etcd.get(keys.power(n)) for n in power}
    assert all(kv is not None and kv.value == power[n][0] for n, kv in stored.items())
    assert c.power_revs == {n: kv.mod_revision for n, kv in stored.items()}
    for nodes in racks.values():  # a rack's caps change in one transaction
        assert len({stored[n].mod_revision for n in nodes}) == 1
    assert all(r <= rev for r in c.power_revs.values()) and len(set(c.power_revs.values())) > 1


def test_reasons_ride_in_their_replicas_parts_and_the_header_stays_small():
    """A degraded replica's reasons are stored with its part, so the header (written
    twice by every commit: the plan and its history) does not grow with the failed GPUs;
    the plan's own reasons (a suspended pin) stay in the header; the assembly equals the
    whole plan's encoding either way."""
    import dataclasses

    from tpflex_controller.planner.model import JobOverrides

    racks = make_racks(12, size=8)
    job = make_job(racks, tp=8, units={"heads": 64, "ffn": 128, "vocab": 64})
    gpus = [g for r in racks.values() for g in r.gpus]
    sizes = []
    for n in (1, 4, 9):
        down = [gpus[8 * k + 1] for k in range(n)]  # one GPU in each of n racks
        result = plan(state(racks, gpu_status=failed(*down)), job, overrides=JobOverrides(pins={0: 8}))
        header, parts = PlanEncoder().split(result, 3, cause="t", now=5.0)
        reference = codec.encode(convert.plan_to_proto(result, 3, cause="t", now=5.0))
        assert planstore.Assembler().whole(header, parts) == reference
        own = list(planstore.decode_plan(header, "h").reasons)
        assert own == [r for r in result.reasons if "operator pin suspended" in r] and own
        for i, lines in result.reason_parts.items():
            assert list(planstore.decode_plan(parts[i], "p").reasons) == list(lines)
        assert sum(len(lines) for lines in result.reason_parts.values()) >= n
        sizes.append(len(header))
        # reasons by replica that do not make up the reasons: all go in the header
        odd = dataclasses.replace(result, reason_parts={0: ("replica 0: not this plan's",)})
        header, parts = PlanEncoder().split(odd, 3, cause="t", now=5.0)
        assert planstore.Assembler().whole(header, parts) == reference
        assert list(planstore.decode_plan(header, "h").reasons) == list(result.reasons)
    assert len(set(sizes)) == 1, sizes  # 1, 4 or 9 degraded replicas: the same header
