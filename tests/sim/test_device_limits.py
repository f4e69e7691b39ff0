"""`tpflex-sim --device-max-w`: per-domain device power limits (issue 39 part 2). A domain
whose GPUs report max limit = default (TDP) has no headroom, and ntp-pw runs its degraded
replicas as plain NTP; a domain with headroom is boosted as before."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tpflex_controller.planner import Policy
from tpflex_controller.sim.cli import main
from tpflex_controller.sim.cluster import SimCluster
from tpflex_controller.sim.config import ClusterConfig, FailureConfig, Placement, SimConfig
from tpflex_controller.sim.engine import simulate

# 4 replicas of one TP8 domain each, TDP 1000 W, rack max 1300 W
SMALL = ClusterConfig(gpus=32, domain_size=8, pp=1, gpus_per_node=4, spares=0, heads=64)


def test_a_domain_without_headroom_runs_plain_ntp_and_one_with_headroom_is_boosted():
    sim = SimCluster(replace(SMALL, device_max_w=(1000.0, 1200.0)))  # even domains: max = TDP
    assert [sim.racks[f"d{d}"].max_w for d in range(4)] == [1000.0, 1200.0, 1000.0, 1200.0]
    stuck = sim.evaluate([0], Policy.NTP_PW, Placement.UNPACKED, 0)  # a GPU of domain 0
    ntp = sim.evaluate([0], Policy.NTP, Placement.UNPACKED, 0)
    assert stuck.boosted_gpus == 0 and stuck.throughput_ratio == ntp.throughput_ratio
    roomy = sim.evaluate([8], Policy.NTP_PW, Placement.UNPACKED, 0)  # a GPU of domain 1
    assert roomy.boosted_gpus == 7 and roomy.throughput_ratio > ntp.throughput_ratio
    assert 0 < roomy.boost_w <= 7 * 200.0  # within the devices' 1200 W


def test_without_device_limits_the_racks_max_stands():
    sim = SimCluster(SMALL)
    assert {r.max_w for r in sim.racks.values()} == {SMALL.max_w}


def test_no_headroom_anywhere_makes_ntp_pw_equal_ntp_over_a_run():
    cfg = SimConfig(cluster=replace(SMALL, gpus=256, device_max_w=(1000.0,)),
                    failures=FailureConfig(rate_scale=200.0), days=3.0, seed=5,
                    policies=(Policy.NTP_PW, Policy.NTP))
    runs = simulate(cfg).runs
    assert runs[Policy.NTP_PW].summary["mean_throughput"] == runs[Policy.NTP].summary["mean_throughput"]
    assert runs[Policy.NTP_PW].summary["mean_throughput"] < 1.0


@pytest.mark.parametrize("value", ["900", "1000,nan", "x"])
def test_device_max_below_tdp_or_not_a_number_exits_2(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--device-max-w", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device-max-w" in err and "Traceback" not in err


def test_cli_run_takes_device_limits(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["run", "--gpus", "256", "--domain-size", "8", "--pp", "1", "--gpus-per-node", "4",
            "--spares", "0", "--days", "2", "--rate-scale", "200", "--seed", "4", "--no-progress",
            "--policy", "ntp-pw,ntp", "--json", str(out)]
    assert main([*argv, "--device-max-w", "1000"]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["cluster"]["device_max_w"] == [1000.0]
    thr = {p: v["mean_throughput"] for p, v in data["policies"].items()}
    assert thr["ntp-pw"] == thr["ntp"]
    assert main(argv) == 0  # headroom (the rack's 1300 W): ntp-pw boosts past ntp
    thr = {p: v["mean_throughput"] for p, v in json.loads(out.read_text())["policies"].items()}
    assert thr["ntp-pw"] > thr["ntp"]
    capsys.readouterr()
