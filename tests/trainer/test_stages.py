"""Pipeline stages (pure): per-stage layouts, per-stage reshards, the 1F1B schedule, and
tpflex-train's --pp arguments. Hypothesis properties against brute-force references."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_trainer.ntp.errors import LayoutError
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
from tpflex_trainer.ntp.reshard_plan import plan_reshard
from tpflex_trainer.ntp.stages import layer_ranges, one_f_one_b, plan_stages, split_stages
from tpflex_trainer.train.schedule import ScheduleError, parse_events

from tests.trainer.test_layout import assert_invariants

BASE_TP = 5


@st.composite
def pipelines(draw):
    """Stage unit counts (the first stage has the embedding's vocab units, the last the
    output layer's) and placements: every replica places every stage, any slots."""
    n_stages = draw(st.integers(1, 4))
    n_replicas = draw(st.integers(1, 3))
    counts = []
    for k in range(n_stages):
        c = {"attn": draw(st.integers(5, 9)), "ffn": draw(st.integers(5, 24))}
        if k in (0, n_stages - 1):
            c["vocab"] = draw(st.integers(5, 16))
        counts.append(c)
    batches = [draw(st.integers(1, 3)) for _ in range(n_replicas)]
    placements = []
    for r in range(n_replicas):
        for k in range(n_stages):
            slots = draw(st.lists(st.integers(0, BASE_TP - 1), min_size=1, max_size=BASE_TP, unique=True))
            placements.append(ReplicaPlacement(r, tuple(slots), batches[r], k))
    return counts, tuple(draw(st.permutations(placements)))


@settings(max_examples=120, deadline=None)
@given(pipe=pipelines())
def test_each_stage_is_laid_out_across_the_replicas_at_its_own_bound(pipe):
    """Per stage: its units owned exactly once per replica, balanced, cores hold their
    partition, t_min = the smallest degree of that stage, and each replica's gradient
    traffic equals the brute-force bound of the stage (``assert_invariants``)."""
    counts, placements = pipe
    layouts = plan_stages(counts, placements, BASE_TP)
    assert [lay.stage for lay in layouts] == list(range(len(counts)))
    for k, lay in enumerate(layouts):
        mine = [p for p in placements if p.stage == k]
        assert lay.t_min == min(p.degree for p in mine)
        assert dict(lay.families) == counts[k]
        assert all(m.member.stage == k for m in lay.members())
        assert_invariants(lay, counts[k])
        for p in mine:  # the replica's local batch on every stage
            assert lay.replica(p.replica).local_batch == p.local_batch


@settings(max_examples=80, deadline=None)
@given(pipe=pipelines(), data=st.data())
def test_a_drain_or_kill_moves_units_only_in_its_stage(pipe, data):
    """One slot of one stage of one replica leaves (drained: it hands its units over;
    killed: its state is lost). Other stages keep their layouts bit for bit and move
    nothing; in the stage concerned every transfer stays in that stage, and a killed
    member's units come from the same stage of another replica (or are missing when it
    was the only replica)."""
    counts, placements = pipe
    before = plan_stages(counts, placements, BASE_TP)
    victim = data.draw(st.sampled_from([p for p in placements if p.degree > 1]) if any(
        p.degree > 1 for p in placements) else st.nothing())
    slot = data.draw(st.sampled_from(victim.slots))
    gone = Member(victim.replica, slot, victim.stage)
    killed = data.draw(st.booleans())
    after_places = tuple(
        ReplicaPlacement(p.replica, tuple(s for s in p.slots if s != slot), p.local_batch, p.stage)
        if p is victim else p for p in placements)
    members = [m.member for lay in before for m in lay.members()]
    holders = [m for m in members if not (killed and m == gone)]
    after = plan_stages(counts, after_places, BASE_TP, before, holders)
    for k, (old, new) in enumerate(zip(before, after, strict=True)):
        plan = plan_reshard(old, new, holders)
        if k != victim.stage:
            assert new.replicas == old.replicas and plan.transfers == () and not plan.missing
            continue
        assert_invariants(new, counts[k])
        assert all(t.src.stage == k and t.dst.stage == k for t in plan.transfers)
        if killed:
            lost = {(f, u) for f, units in old.member(gone).units.items() for u in units}
            for t in plan.transfers:
                if (t.family, t.unit) in lost and t.dst.replica == gone.replica:
                    assert t.src.replica != gone.replica  # peer recovery, same stage
            if len(old.replicas) == 1:
                assert plan.missing
        else:
            assert not plan.missing


def test_placements_must_cover_every_stage_of_every_replica():
    ok = [ReplicaPlacement(r, (0, 1), 2, k) for r in range(2) for k in range(2)]
    assert [len(s) for s in split_stages(ok, 2)] == [2, 2]
    cases = {
        "missing_stage": ok[:-1],
        "stage_batch_mismatch": [*ok[:-1], ReplicaPlacement(1, (0, 1), 3, 1)],
        "stage_out_of_range": [*ok, ReplicaPlacement(0, (0,), 2, 2)],
    }
    for code, placements in cases.items():
        with pytest.raises(LayoutError) as err:
            split_stages(placements, 2)
        assert err.value.code == code, (code, str(err.value))
    with pytest.raises(LayoutError, match="3 layers cannot fill 4 stages"):
        layer_ranges(3, 4)
    assert layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


# ------------------------------------------------------------------ 1F1B schedule

_PEER = {"send_forward": (1, "f"), "recv_forward": (-1, "f"), "send_backward": (-1, "b"),
         "recv_backward": (1, "b")}


def _transfers(act) -> list[tuple[str, int, str, int]]:
    """(kind, neighbour offset, direction, micro) of each transfer of an action."""
    if act.kind == "send_forward_recv_backward":
        return [("send", 1, "f", act.micro), ("recv", 1, "b", act.recv)]
    if act.kind == "send_backward_recv_forward":
        return [("send", -1, "b", act.micro), ("recv", -1, "f", act.recv)]
    if act.kind in _PEER:
        offset, direction = _PEER[act.kind]
        return [(act.kind.split("_")[0], offset, direction, act.micro)]
    return []


def simulate(n_stages: int, micro: int) -> list[list[str]]:
    """Run every stage's schedule with rendezvous transfers (a transfer completes only
    when both sides have posted it; an action's transfers are posted together and it
    ends when all of them completed). Returns each stage's compute log; fails on a
    deadlock."""
    progs = [one_f_one_b(k, n_stages, micro) for k in range(n_stages)]
    pc = [0] * n_stages
    logs: list[list[str]] = [[] for _ in range(n_stages)]
    done: set[tuple] = set()

    def keys(k: int) -> set[tuple]:
        """(direction, micro, sender, receiver) of what stage k has posted now."""
        if pc[k] >= len(progs[k]):
            return set()
        return {(d, m, k, k + off) if kind == "send" else (d, m, k + off, k)
                for kind, off, d, m in _transfers(progs[k][pc[k]])}

    while any(pc[k] < len(progs[k]) for k in range(n_stages)):
        posted = [keys(k) for k in range(n_stages)]
        for k in range(n_stages):
            for key in posted[k]:
                other = key[3] if key[2] == k else key[2]
                assert 0 <= other < n_stages, f"stage {k} talks to missing stage {other}"
                if key in posted[other]:
                    done.add(key)
        moved = False
        for k in range(n_stages):
            if pc[k] < len(progs[k]) and posted[k] <= done:
                act = progs[k][pc[k]]
                if not posted[k]:
                    logs[k].append(f"{act.kind[0].upper()}{act.micro}")
                pc[k] += 1
                moved = True
        assert moved, f"deadlock at {[progs[k][pc[k]] if pc[k] < len(progs[k]) else None for k in range(n_stages)]}"
    return logs


@settings(max_examples=60, deadline=None)
@given(n_stages=st.integers(1, 6), micro=st.integers(1, 9))
def test_one_f_one_b_completes_and_bounds_the_activations_in_flight(n_stages, micro):
    logs = simulate(n_stages, micro)
    for k, log in enumerate(logs):
        assert sorted(log) == sorted([f"F{i}" for i in range(micro)] + [f"B{i}" for i in range(micro)])
        assert [x for x in log if x[0] == "F"] == [f"F{i}" for i in range(micro)]  # in order
        in_flight = peak = 0
        for x in log:
            if x[0] == "B":
                assert f"F{x[1:]}" in log[: log.index(x)]
            in_flight += 1 if x[0] == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= min(n_stages - k, micro)  # 1F1B: at most P - k micro-batches stored
    if n_stages == 1:  # plain gradient accumulation
        assert logs[0] == [x for i in range(micro) for x in (f"F{i}", f"B{i}")]


def test_schedule_events_name_replica_stage_slot():
    sched = parse_events("2:drain=1:0:2,3:kill=0:1:1,5:undrain=1:0:2", 3, 2, 8, 8, pp=2)
    assert sched.out_at(3) == {Member(1, 2, 0)}
    assert sched.kills_at(3) == (Member(0, 1, 1),)
    places = sched.placements(sched.out_at(3))
    assert [(p.replica, p.stage, p.slots) for p in places] == [
        (0, 0, (0, 1, 2)), (0, 1, (0, 1, 2)), (1, 0, (0, 1)), (1, 1, (0, 1, 2))]
    assert len(sched.alive_at(4, after_kills=True)) == 11
    bad = {
        "2:drain=1:2": "REPLICA:STAGE:SLOT",  # --pp 2 needs the stage
        "2:drain=1:2:0": "no replica 1 stage 2 slot 0",
        "2:drain=0:1:0,3:drain=0:1:1,4:drain=0:1:2": "replica 0 stage 1 would have no slot left",
    }
    for text, why in bad.items():
        with pytest.raises(ScheduleError, match=why):
            parse_events(text, 3, 2, 8, 8, pp=2)
    with pytest.raises(ScheduleError, match="REPLICA:SLOT"):
        parse_events("2:drain=1:0:2", 3, 2, 8, 8)  # --pp 1 keeps R:S


def test_tpflex_train_rejects_pipelines_it_cannot_run(tmp_path, capsys):
    from tpflex_trainer.train.cli import build_spec

    from tests.trainer.hf_support import args, make_data, make_model_dir

    data = make_data(tmp_path / "tokens.npy")
    llama = make_model_dir(tmp_path / "llama", "llama", heads=4, kv=2, weights=False)
    tied = make_model_dir(tmp_path / "tied", "qwen3", heads=4, kv=2, tied=True, weights=False, layers=4)
    cases = [
        (args(llama, data, tmp_path / "o", tp=2, pp=3), "--pp: 2 layers cannot fill 3 stages"),
        (args(tied, data, tmp_path / "o", tp=2, pp=2), "--pp: tied input and output embeddings"),
        (args(llama, data, tmp_path / "o", tp=2, pp=2, events="2:drain=0:1"), "--events:"),
        (args(llama, data, tmp_path / "o", tp=2, pp=0), "--pp: must be >= 1"),
    ]
    for argv, why in cases:
        with pytest.raises(SystemExit) as exit_:
            build_spec(argv)
        assert exit_.value.code == 2
        assert why in capsys.readouterr().err
