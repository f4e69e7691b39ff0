"""Failure traces: rates, hardware/software split, repair times, blast radius."""

from __future__ import annotations

import math
import random

import pytest
from tpflex_controller.sim.config import LLAMA3_RATE_PER_GPU_HOUR, Blast, FailureConfig
from tpflex_controller.sim.trace import failure_trace, sample_failed


def _radius(gpus_per_node: int, domain: int):
    def radius(g: int, blast: Blast) -> range:
        size = {Blast.GPU: 1, Blast.NODE: gpus_per_node, Blast.DOMAIN: domain}[blast]
        return range(g - g % size, g - g % size + size)

    return radius


def test_llama3_default_rate():
    assert LLAMA3_RATE_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))


def test_rate_split_and_repairs():
    cfg = FailureConfig(rate_per_gpu_hour=1e-4)
    gpus, hours = 20_000, 24 * 30.0
    events = failure_trace(cfg, gpus, hours, random.Random(7), _radius(4, 32))
    fails = [e for e in events if e.failed]
    # working GPUs stay close to all GPUs, so the count is Poisson(rate * N * hours) minus a
    # thinning of at most the down fraction
    expected = 1e-4 * gpus * hours
    assert abs(len(fails) - expected) <= 4 * math.sqrt(expected) + 0.01 * expected
    hw = sum(e.hardware for e in fails) / len(fails)
    assert abs(hw - 0.78) <= 4 * math.sqrt(0.78 * 0.22 / len(fails))
    pending = {}
    repaired = 0
    for e in events:
        if e.failed:
            pending[e.gpus] = e
            continue
        took = e.time_h - pending.pop(e.gpus).time_h
        repaired += 1
        if e.hardware:
            assert 72.0 - 1e-9 <= took <= 120.0 + 1e-9
        else:
            assert took == pytest.approx(3.0)
    assert repaired > 0.5 * len(fails)
    assert [e.time_h for e in events] == sorted(e.time_h for e in events)


@pytest.mark.parametrize(("blast", "size"), [(Blast.GPU, 1), (Blast.NODE, 4), (Blast.DOMAIN, 32)])
def test_blast_radius_and_no_double_failure(blast, size):
    cfg = FailureConfig(rate_per_gpu_hour=1e-4, blast=blast)
    events = failure_trace(cfg, 3200, 24 * 20.0, random.Random(3), _radius(4, 32))
    down: set[int] = set()
    for e in events:
        if e.failed:
            assert not down & set(e.gpus)
            assert 1 <= len(e.gpus) <= size
            assert len({g // size for g in e.gpus}) == 1
            down |= set(e.gpus)
        else:
            assert set(e.gpus) <= down
            down -= set(e.gpus)
    assert max(len(e.gpus) for e in events) == size


def test_same_seed_same_trace():
    cfg = FailureConfig(rate_per_gpu_hour=1e-4)
    a = failure_trace(cfg, 1000, 500.0, random.Random(1), _radius(4, 8))
    b = failure_trace(cfg, 1000, 500.0, random.Random(1), _radius(4, 8))
    assert a == b and a != failure_trace(cfg, 1000, 500.0, random.Random(2), _radius(4, 8))


def test_sample_failed_is_bernoulli():
    rng = random.Random(5)
    n, f = 100_000, 0.003
    counts = [len(sample_failed(n, f, rng)) for _ in range(20)]
    mean = sum(counts) / len(counts)
    assert abs(mean - n * f) <= 4 * math.sqrt(n * f * (1 - f) / len(counts))
    picked = sample_failed(n, f, rng)
    assert picked == sorted(set(picked)) and all(0 <= g < n for g in picked)
    assert sample_failed(10, 0.0, rng) == [] and sample_failed(10, 1.0, rng) == list(range(10))
