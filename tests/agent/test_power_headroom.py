"""Power limits from the devices, end to end (issue 39 part 2): two real tpflex-agent
processes on the NVML backend over the fake libnvidia-ml (per-GPU limits from its state
file), a real etcd, an in-process controller pushing caps over real gRPC. One rack's GPUs
report H100 SXM limits (max = default = 700 W), the other's have headroom (max 1000 W).
A GPU fails on each (XID 79 from the fake driver): the first rack's replica runs as plain
NTP with the reason and no cap above 700 W, the second is boosted above 700 W and within
its GPUs' max; the agents apply exactly that (nothing refused)."""

from __future__ import annotations

import grpc
import pytest
from tpflex_controller import synthetic
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, types_pb2

from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml, wait_until
from tests.controller.controller_harness import PlanWatcher, start_controller

pytestmark = pytest.mark.slow

GPUS = 4
TDP = 700.0
NO_HEADROOM_MW = 700_000  # H100 SXM: max limit = default limit
HEADROOM_MW = 1_000_000


def agent(node: str, rack: str, etcd_server, fake: FakeNvml, log) -> AgentProcess:
    args = ["--node", node, "--rack", rack, "--etcd", ",".join(etcd_server.endpoints),
            "--listen", "127.0.0.1:0", "--insecure", "--metrics-listen", "127.0.0.1:0",
            "--health-poll-s", "0.1", "--lease-ttl-s", "3", "--backend", "nvml"]
    return AgentProcess(args, env=fake.env(log))


def fake_gpus(path, max_mw: int) -> FakeNvml:
    fake = FakeNvml(path, count=GPUS)
    for i in range(GPUS):
        fake.gpus[i].update(uuid=f"GPU-{path.stem}-{i:04d}", limit_mw=700_000, default_mw=700_000,
                            min_mw=200_000, max_mw=max_mw)
    return fake.write()


def applied_limits(address: str) -> list[float]:
    with grpc.insecure_channel(address) as ch:
        resp = agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
    return [g.power_limit_w for g in resp.gpus]


def refused_sets(log) -> list[str]:
    text = log.read_text() if log.exists() else ""
    return [ln for ln in text.splitlines() if ln.startswith("set_power_limit") and not ln.endswith("rc=0")]


def test_no_headroom_rack_runs_plain_ntp_and_the_other_is_boosted_within_device_limits(
    etcd_server, etcd, tmp_path
):
    build_fake_nvml()
    h100 = fake_gpus(tmp_path / "h100.state", NO_HEADROOM_MW)
    roomy = fake_gpus(tmp_path / "roomy.state", HEADROOM_MW)
    # rack records allow 1300 W: the devices' limits are the tighter ones
    racks = [synthetic.rack(name, 1, GPUS, tdp_w=TDP, min_w=100.0, max_w=1300.0, budget_factor=1.3)
             for name in ("hx", "bx")]
    for r in racks:
        etcd.put(keys.rack(r.name), codec.encode(r))
    logs = {name: tmp_path / f"{name}.log" for name in ("hx", "bx")}
    with agent("hx-n00", "hx", etcd_server, h100, logs["hx"]) as hx, \
            agent("bx-n00", "bx", etcd_server, roomy, logs["bx"]) as bx:
        for node in ("hx-n00", "bx-n00"):
            wait_until(lambda n=node: etcd.get(keys.node(n)), 10, f"{node} registered")
        reg = codec.decode(types_pb2.Node, etcd.get(keys.node("hx-n00")).value)
        assert [(g.default_limit_w, g.max_limit_w) for g in reg.gpus] == [(700.0, 700.0)] * GPUS
        etcd.put(keys.job_spec("job1"), codec.encode(synthetic.job("job1", ["hx", "bx"], GPUS, local_batch=8)))
        watcher = PlanWatcher(etcd, "job1")
        ctl = start_controller(etcd_server.endpoints)
        try:
            first = watcher.wait_generation(1, timeout=15)
            assert all(r.state == types_pb2.REPLICA_HEALTHY for r in first.replicas)

            h100.xid(1, 79, lost=1)
            roomy.xid(1, 79, lost=1)

            def degraded():
                p = watcher.latest()
                return p if p is not None and all(r.state == types_pb2.REPLICA_DEGRADED for r in p.replicas) else None

            plan = wait_until(degraded, 15, "both replicas degraded")
            r_hx, r_bx = sorted(plan.replicas, key=lambda r: r.stages[0].rack != "hx")
            caps = {(c.gpu.node, c.gpu.index): c.cap_w for c in plan.power_caps}

            # no headroom: plain NTP, 3 of 4 GPUs -> local batch 6 of 8, nothing above 700 W
            assert r_hx.tp_degree == 3 and r_hx.local_batch == 6
            reason = "NTP (no power headroom: hx-n00 GPUs max limit = default 700 W)"
            assert reason in r_hx.reason
            assert any(reason in line for line in plan.reasons), plan.reasons
            assert all(w <= TDP for g, w in caps.items() if g[0] == "hx-n00")

            # headroom: boosted above TDP, within the GPUs' reported max (not the rack's 1300 W)
            bx_caps = [w for g, w in caps.items() if g[0] == "bx-n00"]
            assert len(bx_caps) == 3 and all(TDP < w <= HEADROOM_MW / 1000 for w in bx_caps), caps
            assert "no power headroom" not in r_bx.reason

            # the agents apply it, and refuse nothing
            boosted = max(bx_caps)
            wait_until(lambda: sorted(applied_limits(bx.grpc_address))[-3:] == [boosted] * 3, 10,
                       f"bx boosted to {boosted} W")
            assert all(w <= TDP for w in applied_limits(hx.grpc_address))
            assert refused_sets(logs["hx"]) == [] and refused_sets(logs["bx"]) == []
        finally:
            ctl.stop()
            watcher.close()
