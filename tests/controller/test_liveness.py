"""The pure liveness decisions: missed beats, soft failures, escalation to a drain, hangs,
input bounds and the beat rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.liveness import (
    BeatTracker,
    LivenessPolicy,
    TokenBucket,
    apply_failure,
    apply_hang,
    apply_revival,
    check_beat,
    clean_reason,
    declared,
    plan_gpus,
    rank_gpus,
)
from tpflex_controller.spec_checks import InputError, JobFacts
from tpflex_proto import controller_pb2, types_pb2

POLICY = LivenessPolicy(beat_timeout_s=5.0, window_s=100.0, max_soft_failures=3, max_recent=8)
FACTS = JobFacts(replicas=2, ranks=8, base_tp=4, local_batch=4, generation=3)


def fail(rank=1, node="n0", gpu=1, inc=0, reason="signal:SIGKILL", at=0.0):
    return types_pb2.SoftFailure(rank=rank, node=node, gpu=gpu, incarnation=inc, reason=reason, at=at)


def test_soft_failure_bumps_the_epoch_and_is_kept():
    out = apply_failure(None, "j", fail(), POLICY, 10.0, in_plan=True)
    assert out.kind == "soft" and not out.drain
    assert out.record.restart.epoch == 1 and out.record.restart.rank == 1
    assert "rank 1 on n0:1 signal:SIGKILL" in out.record.restart.reason
    assert [f.rank for f in out.record.recent] == [1]
    again = apply_failure(out.record, "j", fail(rank=2, gpu=2), POLICY, 11.0, in_plan=True)
    assert again.record.restart.epoch == 2 and len(again.record.recent) == 2


def test_the_same_death_counts_once():
    first = apply_failure(None, "j", fail(inc=2, reason="signal:SIGKILL"), POLICY, 10.0, in_plan=True)
    # the missed beats of the same process, seen later (or by another replica)
    dup = apply_failure(first.record, "j", fail(inc=2, reason="heartbeat_lost"), POLICY, 16.0, in_plan=True)
    older = apply_failure(first.record, "j", fail(inc=1), POLICY, 16.0, in_plan=True)
    assert dup.kind == older.kind == "duplicate" and dup.record is None
    newer = apply_failure(first.record, "j", fail(inc=3), POLICY, 16.0, in_plan=True)
    assert newer.kind == "soft"


def test_the_death_of_a_rank_whose_failed_gpu_the_plan_dropped_changes_nothing():
    # the failure generation already made its peers abort and re-form; an epoch now (often a
    # beat timeout after the GPU failed) would make every rank re-form once more
    first = apply_failure(None, "j", fail(inc=0), POLICY, 10.0, in_plan=False, gpu_failed=True)
    assert first.kind == "gpu_failed" and first.record is None and not first.drain
    # a rank on a failed GPU that the plan still holds is a soft failure as before
    assert apply_failure(None, "j", fail(inc=0), POLICY, 10.0, in_plan=True, gpu_failed=True).kind == "soft"


def test_a_gpu_outside_the_plan_re_forms_the_groups_but_counts_nothing():
    rec = None
    for inc in range(5):  # never escalates
        out = apply_failure(rec, "j", fail(inc=inc), POLICY, 10.0 + inc, in_plan=False)
        assert out.kind == "outside_plan" and not out.drain
        rec = out.record
    assert rec.restart.epoch == 5 and all(f.outside_plan for f in rec.recent)
    assert apply_failure(rec, "j", fail(inc=4), POLICY, 20.0, in_plan=True).kind == "duplicate"
    assert apply_failure(rec, "j", fail(inc=5), POLICY, 20.0, in_plan=True).kind == "soft"


def test_repeated_soft_failures_of_one_gpu_drain_it_with_the_reasons():
    rec = None
    kinds = []
    for i, reason in enumerate(["signal:SIGKILL", "heartbeat_lost", "exit:5"]):
        out = apply_failure(rec, "j", fail(inc=i, reason=reason, at=10.0 * i), POLICY, 10.0 * i, in_plan=True)
        kinds.append(out.kind)
        rec = out.record
    assert kinds == ["soft", "soft", "hard"]
    assert "n0:1" in out.drain and "signal:SIGKILL, heartbeat_lost, exit:5" in out.drain
    assert rec.restart.epoch == 3 and rec.restart.reason.startswith("hard failure")


def test_failures_outside_the_window_or_on_other_gpus_do_not_escalate():
    rec = apply_failure(None, "j", fail(inc=0, at=0.0), POLICY, 0.0, in_plan=True).record
    rec = apply_failure(rec, "j", fail(inc=1, at=50.0), POLICY, 50.0, in_plan=True).record
    # the first one left the window: two within it
    out = apply_failure(rec, "j", fail(inc=2, at=101.0), POLICY, 101.0, in_plan=True)
    assert out.kind == "soft" and [f.incarnation for f in out.record.recent] == [1, 2]
    other = apply_failure(rec, "j", fail(rank=5, gpu=5, inc=0, at=60.0), POLICY, 60.0, in_plan=True)
    assert other.kind == "soft"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.floats(0, 30)), max_size=40))
def test_escalation_matches_a_count_of_the_window(events):
    """Against an independent model: a failure escalates exactly when, counting the
    non-duplicate in-window failures of its GPU (itself included), it is the 3rd or more."""
    rec, now, seen = None, 0.0, []  # seen: (rank, inc, at) accepted
    for rank, inc, dt in events:
        now += dt
        live = [s for s in seen if now - s[2] <= POLICY.window_s]
        live = live[-POLICY.max_recent:]
        dup = any(r == rank and i >= inc for r, i, _ in live)
        out = apply_failure(rec, "j", fail(rank=rank, gpu=rank, inc=inc, at=now), POLICY, now, in_plan=True)
        if dup:
            assert out.kind == "duplicate"
            continue
        same = sum(1 for r, _, _ in live if r == rank) + 1
        assert out.kind == ("hard" if same >= POLICY.max_soft_failures else "soft")
        assert out.record.restart.epoch == (rec.restart.epoch if rec else 0) + 1
        assert len(out.record.recent) <= POLICY.max_recent
        seen = live + [(rank, inc, now)]
        rec = out.record


def test_a_false_declaration_is_withdrawn_so_the_real_death_counts():
    """Seen in the 10-minute soak: rank 0's beat stream broke on a replica's etcd error,
    the replica declared it (epoch 1) though it lived on and joined the epoch-1 round; its
    SIGKILL a few seconds later, the same incarnation, was a duplicate and no round
    followed: its successor would not join the round it had been in, the survivors waited
    60 s and gave up. A beat at the current epoch withdraws the declaration."""
    first = apply_failure(None, "j", fail(rank=0, gpu=0, inc=1, reason="stream_closed"), POLICY, 10.0, in_plan=True)
    assert declared(first.record, 0, 1) and not declared(first.record, 0, 2) and not declared(None, 0, 1)
    # a beat still at the epoch before the declaration proves nothing (it may predate it)
    assert apply_revival(first.record, 0, 1, applied_epoch=0).kind == "none"
    assert apply_revival(first.record, 0, 2, applied_epoch=1).kind == "none"  # another process
    assert apply_revival(None, 0, 1, applied_epoch=0).kind == "none"
    revived = apply_revival(first.record, 0, 1, applied_epoch=1)
    assert revived.kind == "revived" and revived.record.restart == first.record.restart
    assert list(revived.record.recent) == [] and not revived.drain
    death = apply_failure(revived.record, "j", fail(rank=0, gpu=0, inc=1), POLICY, 16.0, in_plan=True)
    assert death.kind == "soft" and death.record.restart.epoch == 2
    # without the withdrawal the death is swallowed (what the soak hit)
    assert apply_failure(first.record, "j", fail(rank=0, gpu=0, inc=1), POLICY, 16.0, in_plan=True).kind == "duplicate"
    # other ranks' failures stay
    two = apply_failure(first.record, "j", fail(rank=3, gpu=3, inc=0), POLICY, 11.0, in_plan=True).record
    assert [(f.rank, f.incarnation) for f in apply_revival(two, 0, 1, applied_epoch=2).record.recent] == [(3, 0)]
    assert apply_revival(two, 0, 1, applied_epoch=1).kind == "none"  # not yet at the current epoch


def test_a_hang_bumps_the_epoch_once():
    rec = apply_failure(None, "j", fail(), POLICY, 1.0, in_plan=True).record
    out = apply_hang(rec, "j", 4, applied_epoch=1, hung_s=12.5, now=2.0)
    assert out.kind == "hang" and out.record.restart.epoch == 2 and "12.5s" in out.record.restart.reason
    assert list(out.record.recent) == list(rec.recent)  # not counted against a GPU
    assert apply_hang(out.record, "j", 6, applied_epoch=1, hung_s=12.0, now=2.1).kind == "duplicate"
    assert apply_hang(None, "j", 0, applied_epoch=0, hung_s=1.0, now=0.0).record.restart.epoch == 1


def test_tracker_reports_silent_ranks_once_per_incarnation():
    t = BeatTracker(timeout_s=5.0)
    t.beat("j", 0, 0, 0.0)
    t.beat("j", 1, 0, 0.0)
    t.beat("j", 1, 0, 4.0)
    assert t.expired(5.0) == []
    silent = t.expired(5.1)
    assert [(s.rank, s.reason) for s in silent] == [(0, "heartbeat_lost")]
    assert t.expired(100.0)[0].rank == 1 and t.expired(200.0) == []
    t.beat("j", 2, 1, 10.0)
    t.beat("j", 2, 0, 14.0)  # a late beat of the replaced process does not keep it alive
    t.closed("j", 2, 0, 14.0)  # nor does its stream's end mark the new one
    assert [(s.rank, s.incarnation, s.reason) for s in t.expired(15.5)] == [(2, 1, "heartbeat_lost")]
    t.beat("j", 3, 0, 20.0)
    t.closed("j", 3, 0, 21.0)
    assert [s.reason for s in t.expired(25.5)] == ["stream_closed"]
    t.beat("j", 4, 0, 30.0)
    t.forget("j", 4)
    assert t.watched() == 0


def test_beats_are_bounded():
    ok = controller_pb2.Beat(job="j", rank=7, generation=3, epoch=2, step=5, hung_s=1.0)
    check_beat(ok, FACTS, current_epoch=2)
    cases = [
        (dict(rank=8), "invalid", "rank 8"),
        (dict(generation=4), "future", "generation 4"),
        (dict(epoch=3), "future", "epoch 3"),
        (dict(hung_s=math.nan), "invalid", "hung_s"),
        (dict(hung_s=-1.0), "invalid", "hung_s"),
        (dict(hung_s=math.inf), "invalid", "hung_s"),
    ]
    for change, kind, text in cases:
        bad = controller_pb2.Beat()
        bad.CopyFrom(ok)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(InputError) as err:
            check_beat(bad, FACTS, current_epoch=2)
        assert err.value.kind == kind and text in err.value.message


def test_token_bucket_refuses_a_flood_and_refills():
    b = TokenBucket(burst=3, rate=2.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(0.49) is False and b.take(0.51) is True
    assert all(b.take(10.0 + i) for i in range(10))  # one per second is within the rate


def test_reasons_are_printable_and_bounded():
    assert clean_reason("signal:SIGKILL") == "signal:SIGKILL"
    assert clean_reason("x\n\x00y" + "z" * 500) == "x??y" + "z" * 196
    assert clean_reason("") == "unknown"


def test_rank_and_plan_gpus():
    spec = types_pb2.JobSpec(name="j", base_tp=2)
    for r in range(2):
        rep = spec.replicas.add()
        stage = rep.stages.add()
        stage.ranks.extend(types_pb2.GpuRef(node=f"n{r}", index=i) for i in range(2))
    assert rank_gpus(spec) == [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1)]
    plan = types_pb2.Plan(job="j", generation=1)
    rep = plan.replicas.add(index=0, tp_degree=1)
    rep.stages.add(gpus=[types_pb2.GpuRef(node="n0", index=1)])
    assert plan_gpus(plan) == {("n0", 1)} and plan_gpus(None) == set()


def test_policy_is_checked():
    with pytest.raises(ValueError):
        LivenessPolicy(max_soft_failures=0)
    with pytest.raises(ValueError):
        LivenessPolicy(max_recent=2, max_soft_failures=3)
