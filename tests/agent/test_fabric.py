"""The rack from the NVLink fabric: the pure choice (config > fabric > rack0) and a real
``tpflex-agent`` over the fake libnvidia-ml.so.1 (and over simulated GPUs) registering the
derived rack and each GPU's fabric in etcd."""

from __future__ import annotations

import pytest
from tpflex_agent.backend import FabricInfo, FabricState
from tpflex_agent.fabric import DEFAULT_RACK, fabric_rack_name, resolve_rack
from tpflex_agent.settings import load_settings
from tpflex_proto import codec, keys, types_pb2

from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml, wait_until

A = "2f1e9c3a-7b4d-4e8f-9a0b-1c2d3e4f5a6b"
B = "0c0ffee0-0000-4000-8000-000000000001"
RACK_A7 = "nvl-2f1e9c3a7b4d4e8f9a0b1c2d3e4f5a6b-7"


def done(uuid: str = A, clique: int = 7) -> FabricInfo:
    return FabricInfo(uuid, clique, FabricState.COMPLETED)


def test_the_rack_name_is_the_domain_and_a_valid_name():
    assert fabric_rack_name(done()) == RACK_A7
    assert fabric_rack_name(done(clique=4294967295)) == RACK_A7[:-1] + "4294967295"
    load_settings({"agent": {"rack": fabric_rack_name(done(clique=4294967295))}, "grpc": {"insecure": True}}, {})  # valid


@pytest.mark.parametrize("configured, fabrics, expected", [
    ("r9", [done(), done()], ("r9", "config")),                       # explicit config wins
    ("", [done(), done()], (RACK_A7, "fabric")),
    ("", [done()], (RACK_A7, "fabric")),                               # a lost GPU was left out
    ("", [None, None], (DEFAULT_RACK, "default")),                     # HGX: no fabric
    ("", [], (DEFAULT_RACK, "default")),
    ("", [done(), FabricInfo(A, 7, FabricState.IN_PROGRESS)], (DEFAULT_RACK, "default")),
    ("", [done(), FabricInfo(A, 7, FabricState.COMPLETED, status=999)], (DEFAULT_RACK, "default")),
    ("", [done(), None], (DEFAULT_RACK, "default")),
    ("", [done(A, 7), done(A, 8)], (DEFAULT_RACK, "default")),         # two domains on one node
    ("", [done(A, 7), done(B, 7)], (DEFAULT_RACK, "default")),
    ("", [done("00000000-0000-0000-0000-000000000000", 0)], (DEFAULT_RACK, "default")),
])
def test_rack_choice(configured, fabrics, expected):
    choice = resolve_rack(configured, fabrics)
    assert (choice.name, choice.source) == expected and choice.detail


def test_a_bad_simulated_fabric_is_refused():
    with pytest.raises(ValueError, match="sim_fabric"):
        load_settings({"agent": {"sim_fabric": "not-a-uuid/3"}, "grpc": {"insecure": True}}, {})


def registered(etcd, node: str) -> types_pb2.Node:
    kv = wait_until(lambda: etcd.get(keys.node(node)), 15, f"{node} registered")
    return codec.decode(types_pb2.Node, kv.value, kv.key)


def args(node, etcd_server, *extra):
    return ["--node", node, "--etcd", ",".join(etcd_server.endpoints), "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0", "--insecure", *extra]


@pytest.mark.slow
def test_an_nvml_agent_registers_the_rack_its_fabric_says(tmp_path, etcd_server, etcd):
    build_fake_nvml()
    nvml = FakeNvml(tmp_path / "nvml.state", count=4).fabric(A.upper(), 7)
    with AgentProcess(args("f1", etcd_server, "--backend", "nvml"), env=nvml.env()):
        node = registered(etcd, "f1")
    assert (node.rack, node.rack_source, node.backend) == (RACK_A7, "fabric", "nvml")
    assert [(g.fabric_cluster_uuid, g.fabric_clique_id, g.fabric_state) for g in node.gpus] == \
        [(A, 7, types_pb2.FABRIC_COMPLETED)] * 4

    hgx = FakeNvml(tmp_path / "hgx.state", count=2)  # no fabric: NOT_SUPPORTED
    with AgentProcess(args("h1", etcd_server, "--backend", "nvml"), env=hgx.env()):
        node = registered(etcd, "h1")
    assert (node.rack, node.rack_source) == (DEFAULT_RACK, "default")
    assert {g.fabric_state for g in node.gpus} == {types_pb2.FABRIC_NOT_SUPPORTED}


@pytest.mark.slow
def test_an_explicit_rack_wins_over_the_simulated_fabric(etcd_server, etcd):
    sim = ["--backend", "sim", "--sim-gpus", "2", "--sim-fabric", f"{A}/7"]
    with AgentProcess(args("s1", etcd_server, *sim, "--rack", "r-config")):
        node = registered(etcd, "s1")
    assert (node.rack, node.rack_source) == ("r-config", "config")
    assert {g.fabric_clique_id for g in node.gpus} == {7}  # still reported
    with AgentProcess(args("s2", etcd_server, *sim)):
        assert (registered(etcd, "s2").rack, registered(etcd, "s2").rack_source) == (RACK_A7, "fabric")
