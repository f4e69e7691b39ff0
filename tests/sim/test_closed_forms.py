"""The simulator against the closed forms of issue 6 ("Must agree with"), on uniform
random failures, within sampling error (4 standard errors)."""

from __future__ import annotations

import math

import pytest
from tpflex_controller.planner import Policy
from tpflex_controller.sim.cluster import SimCluster
from tpflex_controller.sim.config import ClusterConfig, Placement
from tpflex_controller.sim.sweep import (
    dp_drop_packed,
    dp_drop_unpacked,
    ntp_unpacked,
    sample_losses,
)

U, K = Placement.UNPACKED, Placement.PACKED
Z = 4.0


def _mean_sem(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def exact_ntp_loss(f: float, t: int, pp: int) -> float:
    """E[max over the replica's stages of failed GPUs] / T (min_tp = 1: no drop matters,
    a stage with every GPU failed loses T/T either way)."""
    return sum(1 - _binom_cdf(k - 1, t, f) ** pp for k in range(1, t + 1)) / t


def _sim(t: int, pp: int, replicas: int) -> SimCluster:
    return SimCluster(
        ClusterConfig(gpus=t * pp * replicas, domain_size=t, pp=pp, gpus_per_node=t if t < 4 else 4,
                      min_tp=1, heads=max(128, t))
    )


@pytest.mark.parametrize(("t", "pp", "f"), [(8, 4, 0.004), (32, 8, 0.001)])
def test_dp_drop_unpacked_loses_one_minus_survival_of_replica(t, pp, f):
    sim = _sim(t, pp, 256)
    losses = sample_losses(sim, f, 24, "dp-u", (Policy.DP_DROP,), (U,))[(Policy.DP_DROP, U)]
    mean, sem = _mean_sem(losses)
    assert abs(mean - dp_drop_unpacked(f, t * pp)) <= Z * sem


@pytest.mark.parametrize(("t", "pp", "f"), [(8, 4, 0.004), (32, 8, 0.004)])
def test_dp_drop_packed_loses_about_one_minus_survival_of_domain(t, pp, f):
    sim = _sim(t, pp, 256)
    losses = sample_losses(sim, f, 24, "dp-p", (Policy.DP_DROP,), (K,))[(Policy.DP_DROP, K)]
    mean, sem = _mean_sem(losses)
    # packing drops ceil(degraded domains / P) replicas: at most one replica above the form
    assert dp_drop_packed(f, t) - Z * sem <= mean <= dp_drop_packed(f, t) + 1 / 256 + Z * sem


def test_ntp_unpacked_without_pp_loses_exactly_the_failed_fraction():
    t, f = 32, 0.003
    sim = _sim(t, 1, 1024)
    losses = sample_losses(sim, f, 16, "ntp1", (Policy.NTP,), (U,))[(Policy.NTP, U)]
    mean, sem = _mean_sem(losses)
    assert abs(mean - ntp_unpacked(f, t, t)) <= Z * sem


@pytest.mark.parametrize(("t", "pp", "f"), [(32, 8, 0.0005), (8, 4, 0.002)])
def test_ntp_unpacked_with_pp_loses_about_g_over_t_times_f(t, pp, f):
    sim = _sim(t, pp, 256)
    losses = sample_losses(sim, f, 24, "ntp", (Policy.NTP,), (U,))[(Policy.NTP, U)]
    mean, sem = _mean_sem(losses)
    exact = exact_ntp_loss(f, t, pp)
    assert abs(mean - exact) <= Z * sem
    # (G/T) f counts every failed GPU; a replica with failures in two stages loses only the
    # worse one, so the closed form is an upper bound that is close at small f
    closed = ntp_unpacked(f, t * pp, t)
    assert exact <= closed <= exact * (1 + (t * pp) * f)


def test_policies_order_on_the_same_failures():
    sim = _sim(32, 8, 64)
    policies = (Policy.NTP_PW, Policy.NTP, Policy.DP_DROP)
    losses = sample_losses(sim, 0.003, 6, "order", policies, (U, K))
    for placement in (U, K):
        for k in range(6):
            pw, ntp, dp = (losses[(p, placement)][k] for p in policies)
            assert pw <= ntp <= dp
    assert all(a <= b for a, b in zip(losses[(Policy.DP_DROP, K)], losses[(Policy.DP_DROP, U)], strict=True))
