"""Agent latency benchmark (issue 3). Prints one JSON line.

- xid_to_visible_*: an XID 79 raised in the simulated backend (the point where NVML would
  deliver it) until a separate etcd client's watch sees health/<node> with that GPU FAILED.
  The path measured is the agent's own: event thread -> health state machine -> etcd put.
- apply_plan_{8,72}_p99_ms: ApplyPowerPlan over a real gRPC channel to an agent with 8 and
  with 72 simulated GPUs; every plan changes every GPU's cap, so every call writes.
- Baselines in the same run: a bare etcd put (etcd_put_p50_ms) and a bare gRPC round trip
  to the same server (grpc.health.v1 Check, grpc_noop_p50_ms).

Run: PYTHONPATH=. .venv/bin/python bench/agent_latency.py (``--quick``: 5 XIDs, 20 plans
and 20 baseline calls each, the same keys, seconds; for the test suite).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tpflex_agent.membership import Membership
from tpflex_proto import agent_pb2, codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.agent.conftest import sim_settings, start_agent, stop_agent
from tests.support.etcd_server import EtcdCluster

XID_SAMPLES = 200
APPLY_SAMPLES = 500
BASELINE_SAMPLES = 300


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1000.0, 3)


def etcd_put_baseline(etcd: Etcd) -> list[float]:
    value = b"x" * 256
    out = []
    for i in range(BASELINE_SAMPLES):
        t0 = time.perf_counter()
        etcd.put(f"/bench/put/{i % 10}", value)
        out.append(time.perf_counter() - t0)
    return out


def grpc_noop_baseline(channel: grpc.Channel) -> list[float]:
    stub = health_pb2_grpc.HealthStub(channel)
    req = health_pb2.HealthCheckRequest(service="tpflex.v1.Agent")
    out = []
    for _ in range(BASELINE_SAMPLES):
        t0 = time.perf_counter()
        stub.Check(req, timeout=5)
        out.append(time.perf_counter() - t0)
    return out


def xid_to_visible(etcd_endpoints: list[str]) -> list[float]:
    agent = start_agent(sim_settings(node="bench-xid", gpus=8, health={"debounce_s": 1.0, "poll_s": 0.5}))
    writer, reader = Etcd(etcd_endpoints), Etcd(etcd_endpoints)
    member = Membership(writer, agent.core, agent_address="bench:1", ttl_s=5).start()
    cond = threading.Condition()
    latest: dict[str, types_pb2.NodeHealth] = {}

    def on_events(events):
        for ev in events:
            if ev.kind == "put":
                with cond:
                    latest["h"] = codec.decode(types_pb2.NodeHealth, ev.value)
                    latest["t"] = time.perf_counter()
                    cond.notify_all()

    def wait_state(index: int, state: int) -> float:
        with cond:
            assert cond.wait_for(lambda: "h" in latest and latest["h"].gpus[index].state == state, 5)
            return latest["t"]

    watch = reader.watch_prefix(keys.health("bench-xid"), on_events)
    out = []
    try:
        assert member.registered.wait(5) and watch.established.wait(5)
        for k in range(XID_SAMPLES):
            index = k % 8
            t0 = time.perf_counter()
            agent.backend.inject_fault(index, "xid79")
            out.append(wait_state(index, types_pb2.GPU_FAILED) - t0)
            agent.core.inject_fault(index, "recover", 0.0)
            wait_state(index, types_pb2.GPU_HEALTHY)
    finally:
        watch.cancel()
        member.stop()
        stop_agent(agent)
        writer.close()
        reader.close()
    return out


def apply_plan(gpus: int) -> tuple[list[float], list[float] | None]:
    agent = start_agent(sim_settings(node=f"bench-{gpus}", gpus=gpus))
    try:
        d = agent.backend.devices()[0]
        caps = (d.default_limit_w * 1.1, d.default_limit_w * 0.9)
        out = []
        for gen in range(1, APPLY_SAMPLES + 1):
            req = agent_pb2.ApplyPowerPlanRequest(generation=gen)
            for i in range(gpus):
                req.caps.add(gpu=types_pb2.GpuRef(node=agent.settings.node, index=i),
                             cap_w=caps[gen % 2], locked_sm_clock_mhz=0)
            t0 = time.perf_counter()
            resp = agent.stub.ApplyPowerPlan(req, timeout=5)
            out.append(time.perf_counter() - t0)
            assert resp.outcome == agent_pb2.ApplyPowerPlanResponse.APPLIED
        noop = grpc_noop_baseline(agent.channel) if gpus == 8 else None
        return out, noop
    finally:
        stop_agent(agent)


def main(argv: list[str] | None = None) -> None:
    global XID_SAMPLES, APPLY_SAMPLES, BASELINE_SAMPLES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 XIDs, 20 plans and baseline calls (the same JSON keys)")
    if ap.parse_args(argv).quick:
        XID_SAMPLES, APPLY_SAMPLES, BASELINE_SAMPLES = 5, 20, 20
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    with EtcdCluster(1) as cluster:
        etcd = Etcd(cluster.endpoints)
        try:
            put = etcd_put_baseline(etcd)
            xid = xid_to_visible(cluster.endpoints)
        finally:
            etcd.close()
    apply8, noop = apply_plan(8)
    apply72, _ = apply_plan(72)
    print(json.dumps({
        "xid_to_visible_p50_ms": pct(xid, 0.5),
        "xid_to_visible_p99_ms": pct(xid, 0.99),
        "apply_plan_8_p99_ms": pct(apply8, 0.99),
        "apply_plan_72_p99_ms": pct(apply72, 0.99),
        "etcd_put_p50_ms": pct(put, 0.5),
        "grpc_noop_p50_ms": pct(noop, 0.5),
        "apply_plan_72_p50_ms": pct(apply72, 0.5),
        "xid_samples": len(xid),
        "apply_samples": len(apply72),
        "backend": "sim",
    }))


if __name__ == "__main__":
    main()
