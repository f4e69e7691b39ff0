"""The rollout tracker (pure): phases of one plan generation."""

from __future__ import annotations

from tpflex_controller.rollout import Phase, Rollout, RolloutTracker, event_phases
from tpflex_proto import types_pb2


def _rollout(gen: int, nodes: dict[str, int], ranks: int = 3) -> Rollout:
    return Rollout("j", gen, types_pb2.Event(seq=gen), dict(nodes), ranks)


def test_power_applied_only_when_every_changed_node_holds_its_generation():
    t = RolloutTracker()
    r = _rollout(2, {"a": 5, "b": 7})
    assert t.start(r, 1.0, 1.1) == [Phase.DETECTED, Phase.COMMITTED]
    assert t.power_applied("a", 4, 1.2) == []  # an older node plan does not count
    assert t.power_applied("a", 5, 1.3) == []
    assert t.power_applied("b", 7, 1.4) == [r]
    assert r.reached[Phase.POWER_APPLIED] == 1.4
    assert t.power_applied("b", 7, 1.5) == []  # reached once
    assert [(p.phase, p.at) for p in event_phases(r)] == [
        ("detected", 1.0), ("committed", 1.1), ("power_applied", 1.4),
    ]


def test_no_caps_to_send_means_power_applied_at_commit():
    t = RolloutTracker()
    r = _rollout(1, {})
    assert t.start(r, 1.0, 1.5) == [Phase.DETECTED, Phase.COMMITTED, Phase.POWER_APPLIED]
    assert r.reached[Phase.POWER_APPLIED] == 1.5


def test_acked_when_every_rank_acked_this_generation_or_newer():
    t = RolloutTracker()
    r = _rollout(3, {}, ranks=3)
    t.start(r, 0.0, 0.1)
    acks = {0: 3, 1: 2, 7: 3}  # rank 1 still at the old generation
    assert t.acks_seen("j", acks, {0, 1, 7}, 0.2) is None
    acks[1] = 3
    assert t.acks_seen("j", acks, {1}, 0.3) is r
    assert r.done() and r.reached[Phase.ACKED] == 0.3
    assert t.acks_seen("j", acks, {1}, 0.4) is None


def test_a_newer_generation_replaces_the_unfinished_rollout():
    t = RolloutTracker()
    old = _rollout(1, {"a": 1})
    t.start(old, 0.0, 0.1)
    new = _rollout(2, {"a": 2})
    t.start(new, 0.2, 0.3)
    assert t.get("j") is new
    assert t.power_applied("a", 1, 0.4) == []  # the old generation's caps are not enough
    assert t.power_applied("a", 2, 0.5) == [new]
