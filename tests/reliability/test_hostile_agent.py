"""Issue 16, defect 2: etcd's desired power stays authoritative over any gRPC push, a
generation regression is resolved, divergence is measured, and plaintext gRPC is an
explicit choice. Real etcd, real ``tpflex-agent`` processes (simulated GPUs, and the NVML
backend on the fake libnvidia-ml), a real ``tpflex-controller`` process.

Before the fix: an ``ApplyPowerPlan`` with generation 2^64-1 was applied, and every later
push of the controller was refused as stale, also after a controller restart; a desired
plan with an older generation in etcd (a restored snapshot) was ignored; the agent served
plaintext gRPC without being asked to."""

from __future__ import annotations

import socket

import grpc
import pytest
from tpflex_proto import codec, keys, types_pb2

from tests.agent.support import AGENT_BIN, FakeNvml, build_fake_nvml, wait_until
from tests.reliability.fleet import SIM_TDP_W, Fleet, agent_metric, record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _node_caps(fleet: Fleet, node: str) -> dict[int, float]:
    return {i: w for (n, i), w in fleet.applied_caps().items() if n == node}


def test_a_forged_push_cannot_stick_and_etcd_going_back_is_followed(fleet):
    fleet.start_agents()
    fleet.put_job()
    ctl = fleet.start_controller("c1")
    ctl.wait_http()
    fleet.wait_generation(1, timeout=20)
    fleet.inject("rack0-n00", 0, "xid79")
    fleet.wait_generation(2, timeout=20)
    wait_until(fleet.caps_converged, 20, "boosted caps applied")
    boosted = _node_caps(fleet, "rack0-n01")
    assert max(boosted.values()) > SIM_TDP_W

    for node in fleet.agents:  # anyone who reaches the port, with a huge generation
        with pytest.raises(grpc.RpcError) as err:
            fleet.push(node, 2**64 - 1, {0: 200.0, 1: 200.0})
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not the desired state in etcd" in err.value.details()
    assert fleet.caps_converged() and _node_caps(fleet, "rack0-n01") == boosted
    assert fleet.agent_metric("rack0-n01", 'tpflex_agent_power_pushes_refused_total{node="rack0-n01"}') >= 1

    ctl.terminate()  # a controller restart, then a repair: its pushes are applied
    ctl = fleet.start_controller("c1")
    fleet.inject("rack0-n00", 0, "recover")
    fleet.wait_generation(3, timeout=20)
    wait_until(fleet.caps_converged, 20, "the repaired plan's caps applied after the restart")
    assert set(_node_caps(fleet, "rack0-n01").values()) == {SIM_TDP_W}

    # etcd restored from an older snapshot: power/<node> goes back to an older generation
    current = codec.decode(types_pb2.NodePowerPlan, fleet.etcd.get(keys.power("rack0-n01")).value)
    older = types_pb2.NodePowerPlan(node="rack0-n01", generation=current.generation - 1)
    for i in (0, 1):
        older.caps.add(gpu=types_pb2.GpuRef(node="rack0-n01", index=i), cap_w=650.0)
    fleet.etcd.put(keys.power("rack0-n01"), codec.encode(older))
    wait_until(lambda: _node_caps(fleet, "rack0-n01") == {0: 650.0, 1: 650.0}, 10,
               "the older desired caps applied (etcd is the authority)")
    name = 'tpflex_agent_power_generation_regressions_total{node="rack0-n01"}'
    assert fleet.agent_metric("rack0-n01", name) >= 1
    assert fleet.agent_metric("rack0-n01", 'tpflex_agent_power_divergent_gpus{node="rack0-n01"}') == 0
    record("agent_power_authority", "ApplyPowerPlan with generation 2^64-1 and 200 W caps to every "
           "agent; controller restart and a repair; power/<node> rewritten with an older generation",
           "the forged pushes are refused and change no cap; the controller's later plans are "
           "applied; the older desired caps in etcd are applied (a regression, counted)",
           {"generations": fleet.history()})


def test_divergence_from_the_desired_caps_is_measured_and_corrected(etcd_server, etcd, tmp_path):
    from tests.agent.support import AgentProcess

    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=2).set(1, deny_set=1)  # GPU 1 refuses limits
    plan = types_pb2.NodePowerPlan(node="g1", generation=3)
    plan.caps.add(gpu=types_pb2.GpuRef(node="g1", index=1), cap_w=820.0)
    etcd.put(keys.power("g1"), codec.encode(plan))
    args = ["--node", "g1", "--rack", "r1", "--backend", "nvml", "--etcd", ",".join(etcd_server.endpoints),
            "--listen", "127.0.0.1:0", "--insecure", "--metrics-listen", "127.0.0.1:0",
            "--power-check-s", "0.3"]
    with AgentProcess(args, env=fake.env(tmp_path / "nvml.log")) as a:
        diverged = 'tpflex_agent_power_divergent_gpus{node="g1"}'
        wait_until(lambda: agent_metric(a, diverged) == 1, 10, "GPU 1 measured as divergent")
        fake.set(1, deny_set=0)  # the device takes limits again: the next check corrects it
        wait_until(lambda: agent_metric(a, diverged) == 0, 10, "divergence corrected")
        assert agent_metric(a, 'tpflex_agent_power_corrections_total{node="g1"}') >= 1
        assert agent_metric(a, f'tpflex_gpu_power_limit_watts{{Hostname="{socket.gethostname()}",'
                            'UUID="GPU-fake-0001",gpu="1",node="g1"}') == 820.0


def test_plaintext_grpc_is_an_explicit_choice_and_logged_loudly(tmp_path):
    import subprocess

    from tests.agent.support import AgentProcess

    base = [str(AGENT_BIN), "--backend", "sim", "--node", "p", "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs an explicit --insecure" in refused.stderr
    with AgentProcess(base[1:] + ["--insecure"]) as a:
        wait_until(lambda: "INSECURE: gRPC in plaintext" in a.stderr(), 10, "the warning")

