"""The shared reconnect backoff: doubling, capped, jittered (no lockstep), reset."""

from __future__ import annotations

import random

import pytest
from tpflex_proto.backoff import Backoff, delay


def test_pauses_double_up_to_the_cap_within_half_to_whole_of_each_step():
    b = Backoff(0.1, 1.0, rng=random.Random(1))
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for step in steps:
        pause = b.next()
        assert step / 2 <= pause <= step
    b.reset()
    assert 0.05 <= b.next() <= 0.1


def test_many_clients_do_not_retry_in_lockstep():
    # 1,000 clients failing at once: their third pauses spread over [0.2, 0.4] s
    pauses = []
    for seed in range(1000):
        b = Backoff(0.1, 2.0, rng=random.Random(seed))
        b.next(), b.next()
        pauses.append(b.next())
    assert min(pauses) >= 0.2 and max(pauses) <= 0.4
    assert len({round(p, 3) for p in pauses}) > 150  # spread, not one instant
    buckets = [sum(1 for p in pauses if 0.2 + i * 0.05 <= p < 0.25 + i * 0.05) for i in range(4)]
    assert min(buckets) > 150  # roughly uniform over the window


def test_delay_by_attempt_matches_the_schedule_and_bad_bounds_are_refused():
    rng = random.Random(3)
    assert 0.5 <= delay(1, 1.0, 10.0, rng) <= 1.0
    assert 5.0 <= delay(9, 1.0, 10.0, rng) <= 10.0
    with pytest.raises(ValueError):
        Backoff(0, 1.0)
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
