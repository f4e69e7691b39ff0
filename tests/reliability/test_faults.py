"""Fault scenarios against real processes: real etcd (single member and a 3-member
cluster), real ``tpflex-controller`` and ``tpflex-agent`` processes (simulated GPUs), and
``ControlClient`` trainers, one per rank. Each test records its measured figures."""

from __future__ import annotations

import time

import httpx
import pytest
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.agent.support import wait_until
from tests.controller.controller_harness import wait_leader
from tests.reliability.fleet import Fleet, Stopwatch, contiguous, record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def fleet_factory(tmp_path):
    made: list[Fleet] = []

    def make(endpoints, **kw) -> Fleet:
        f = Fleet(endpoints, tmp_path, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def _boot(fleet: Fleet, controllers=("c1",)) -> None:
    fleet.start_agents()
    fleet.put_job()
    for name in controllers:
        fleet.start_controller(name)
    for c in fleet.controllers.values():
        c.wait_http()
    fleet.wait_generation(1, timeout=20)
    lead, _ = wait_leader(fleet.etcd)
    fleet.start_ranks([fleet.trainer_endpoint(fleet.controllers[lead])] +
                      [fleet.trainer_endpoint(c) for n, c in fleet.controllers.items() if n != lead])
    wait_until(lambda: fleet.ranks_at(1), 15, "every rank acked generation 1")


def _etcd_leader_index(cluster) -> int:
    for i, m in enumerate(cluster.members):
        c = Etcd([m.endpoint], timeout=2.0)
        try:
            st = c.status()
            if st.header.member_id == st.leader:
                return i
        finally:
            c.close()
    raise AssertionError("no etcd leader")


def test_etcd_member_loss_mid_reconfiguration(etcd_cluster3, fleet_factory):
    fleet = fleet_factory(etcd_cluster3.endpoints, agent_ttl=10)
    _boot(fleet)
    victim = _etcd_leader_index(etcd_cluster3)
    sw = Stopwatch()
    fleet.inject("rack0-n01", 0, "xid79")
    etcd_cluster3.members[victim].kill()  # the etcd leader, while the failure is being handled
    plan = fleet.wait_generation(2, timeout=30)
    commit_ms = sw.ms()
    wait_until(fleet.caps_converged, 20, "agents at the plan's caps")
    wait_until(lambda: fleet.ranks_at(2), 20, "every rank acked generation 2")
    converged_ms = sw.ms()
    assert plan.cause == "gpu_failed" and fleet.degrees() == [3, 4]
    assert fleet.history() == [1, 2]  # committed exactly once
    assert all(r.generations == [1, 2] for r in fleet.ranks)
    etcd_cluster3.restart_member(victim)
    record("etcd_member_loss", "kill -9 the etcd leader (1 of 3 members) right after a GPU failure",
           "plan committed once (history [1, 2]); agents at the plan's caps; all 8 ranks got and acked gen 2",
           {"failure_to_commit_ms": commit_ms, "failure_to_converged_ms": converged_ms})


def test_leader_killed_between_commit_and_power_push(etcd_server, fleet_factory):
    fleet = fleet_factory(etcd_server.endpoints, agent_ttl=10)
    _boot(fleet, controllers=("c1", "c2"))
    leader, _ = wait_leader(fleet.etcd)
    # the agent of the degraded rack cannot take a push: the commit happens, the push cannot
    fleet.pause("rack0-n00")
    fleet.pause("rack0-n01")
    sw = Stopwatch()
    drain = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node="rack0-n01", index=1), drained=True,
                                  reason="reliability test", at=time.time())
    fleet.etcd.put(keys.gpu_override("rack0-n01", 1), codec.encode(drain))  # an operator drain
    plan = fleet.wait_generation(2)
    fleet.controllers[leader].kill()  # kill -9 between commit and power push
    killed = sw.ms()
    fleet.resume("rack0-n00")
    fleet.resume("rack0-n01")
    new_leader, _ = wait_leader(fleet.etcd, other_than=leader, timeout=10)
    wait_until(fleet.caps_converged, 20, "agents at the plan's caps")
    caps_ms = sw.ms()
    wait_until(lambda: fleet.ranks_at(fleet.plan().generation), 20, "every rank acked")
    final = fleet.plan()
    assert plan.cause == "drain" and final.generation >= 2
    assert contiguous(fleet.history()) and fleet.history()[0] == 1
    boosted = [c for c in final.power_caps if c.cap_w > 700.0]
    assert boosted, "the degraded rack is boosted"
    for r in fleet.ranks:
        assert contiguous(r.generations), r.generations
    record("leader_killed_before_push",
           "agents of the degraded rack paused (SIGSTOP) so the push cannot land; drain a GPU; "
           "kill -9 the leader once the plan is committed; SIGCONT the agents",
           f"new leader {new_leader} finishes the rollout; history {fleet.history()} contiguous; "
           "every agent at the plan's caps; all 8 ranks ack the final generation",
           {"commit_to_kill_ms": killed, "drain_to_caps_applied_ms": caps_ms,
            "boosted_gpus": len(boosted)})


def _readyz(ctl) -> int:
    try:
        return httpx.get(ctl.rest_url + "/readyz", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_etcd_down_for_10_seconds(etcd_server, fleet_factory):
    fleet = fleet_factory(etcd_server.endpoints, agent_ttl=5)
    _boot(fleet)
    ctl = fleet.controllers["c1"]
    etcd_server.members[0].kill()
    down = time.monotonic()
    wait_until(lambda: _readyz(ctl) == 503, 10, "/readyz 503")
    time.sleep(max(0.0, 10.0 - (time.monotonic() - down)))  # the injected outage lasts 10 s
    alive = [a.proc.poll() is None for a in fleet.agents.values()] + [ctl.proc.poll() is None]
    assert all(alive), "every process kept running"
    assert all(r.latest_plan().generation == 1 for r in fleet.ranks)  # training goes on with the last plan
    etcd_server.restart_member(0)
    sw = Stopwatch()
    wait_until(lambda: _readyz(ctl) == 200, 20, "/readyz 200")
    ready_ms = sw.ms()
    wait_until(lambda: len(fleet.etcd.get_prefix("/tpflex/v1/nodes/")[0]) == 4, 20, "agents registered")
    # an agent whose lease lapsed while etcd was down (a loaded machine) re-registers: the
    # job may go through node_lost/node_joined first; it must be whole again on its own
    wait_until(lambda: fleet.degrees() == [4, 4], 20, "the job whole after the outage")
    before = fleet.plan().generation
    fleet.inject("rack1-n00", 1, "xid79")
    wait_until(lambda: fleet.degrees() == [4, 3], 20, "the failure after the outage planned")
    final = fleet.plan().generation
    wait_until(lambda: fleet.ranks_at(final), 20, f"every rank acked generation {final}")
    wait_until(fleet.caps_converged, 20, "agents at the plan's caps")
    recovered_ms = sw.ms()
    assert final > before and contiguous(fleet.history()) and fleet.history()[0] == 1
    assert all(contiguous(r.generations) and r.generations[-1] == final for r in fleet.ranks)
    assert all(a.proc.poll() is None for a in fleet.agents.values()) and ctl.proc.poll() is None
    record("etcd_down_10s", "the only etcd member killed for 10 s, then restarted on its data",
           "controller, 4 agents, 8 ranks keep running (ranks keep gen 1); /readyz 503 then 200; "
           "a GPU failure after the outage is planned, applied and acked, no process restarted",
           {"outage_s": 10.0, "etcd_back_to_ready_ms": ready_ms, "etcd_back_to_failure_acked_ms": recovered_ms,
            "generations": fleet.history()})


def test_agent_frozen_past_its_lease(etcd_server, fleet_factory):
    fleet = fleet_factory(etcd_server.endpoints, agent_ttl=2)
    _boot(fleet)
    sw = Stopwatch()
    fleet.pause("rack1-n01")
    lost = fleet.wait_generation(2, timeout=15)
    lost_ms = sw.ms()
    assert lost.cause == "node_lost" and fleet.degrees() == [4, 2]
    assert "rack1-n01" not in {g.node for rep in lost.replicas for st in rep.stages for g in st.gpus}
    wait_until(lambda: fleet.ranks_at(2), 15, "every rank acked generation 2")
    sw = Stopwatch()
    fleet.resume("rack1-n01")
    back = fleet.wait_generation(3, timeout=15)
    back_ms = sw.ms()
    assert back.cause == "node_joined" and fleet.degrees() == [4, 4]
    wait_until(fleet.caps_converged, 15, "agents at the plan's caps")
    wait_until(lambda: fleet.ranks_at(3), 15, "every rank acked generation 3")
    assert fleet.history() == [1, 2, 3]
    record("agent_frozen", "SIGSTOP one agent (lease TTL 2 s) until its lease lapses; then SIGCONT",
           "its GPUs count as failed (gen 2, degrees [4, 2], cause node_lost); it re-registers and "
           "the job is restored (gen 3, [4, 4]); caps applied; all ranks ack",
           {"freeze_to_replan_ms": lost_ms, "thaw_to_restore_ms": back_ms})


def test_controller_restart_while_trainers_stream(etcd_server, fleet_factory):
    fleet = fleet_factory(etcd_server.endpoints)
    _boot(fleet)
    ctl = fleet.controllers["c1"]
    restarts, faults = 3, [("rack0-n00", 0), ("rack1-n01", 1), ("rack0-n01", 1)]
    for i, (node, gpu) in enumerate(faults[:restarts]):
        ports = (ctl.rest_port, ctl.trainer_port)
        ctl.terminate()
        fleet.inject(node, gpu, "xid79")  # a change while no controller runs
        ctl = fleet.start_controller("c1", ports=ports)
        fleet.wait_generation(i + 2, timeout=20)
        wait_until(lambda g=i + 2: fleet.ranks_at(g), 20, f"every rank acked generation {i + 2}")
    assert fleet.history() == [1, 2, 3, 4]
    missed = [r.config.rank for r in fleet.ranks if r.generations != [1, 2, 3, 4]]
    assert not missed, {r.config.rank: r.generations for r in fleet.ranks}
    record("controller_restart", f"{restarts} controller restarts (SIGTERM, a new process on the same "
           "ports); a GPU fails while it is down each time",
           "8 ranks reconnect on their own and receive every generation 1..4 exactly once, in order",
           {"restarts": restarts, "ranks": len(fleet.ranks), "generations_missed": 0})


@pytest.mark.parametrize("hold", [0.5, 0.0], ids=["hold-down", "no-hold-down"])
def test_flapping_gpu_is_damped(etcd_server, fleet_factory, hold):
    fleet = fleet_factory(etcd_server.endpoints, hold_down_s=hold)
    _boot(fleet)
    seen_failures = []
    key = keys.health("rack0-n00")

    def on_health(events):
        for ev in events:
            if ev.key == key and ev.kind == "put":
                nh = codec.decode(types_pb2.NodeHealth, ev.value)
                failed = any(g.index == 1 and g.state == types_pb2.GPU_FAILED for g in nh.gpus)
                if not seen_failures or seen_failures[-1] != failed:
                    seen_failures.append(failed)

    watch = fleet.etcd.watch_prefix(key, on_health)
    assert watch.established.wait(5)
    flaps = 10
    for _ in range(flaps):
        fleet.inject("rack0-n00", 1, "xid79")
        wait_until(lambda: fleet.degrees() == [3, 4], 10, "failure planned")
        fleet.inject("rack0-n00", 1, "recover")
        time.sleep(0.2)  # the injected flap period
    sw = Stopwatch()
    if hold:
        assert fleet.plan().generation == 2 and fleet.degrees() == [3, 4]
        fleet.wait_generation(3, timeout=hold * 8 + 5)
        assert fleet.plan().cause == "gpu_recovered" and fleet.history() == [1, 2, 3]
    wait_until(lambda: fleet.degrees() == [4, 4], 10, "restored")
    released_ms = sw.ms()
    watch.cancel()
    failures_in_etcd = sum(1 for f in seen_failures if f)
    assert failures_in_etcd >= flaps // 2, seen_failures  # the flaps did reach the controller
    reconfigurations = len(fleet.history()) - 1
    if not hold:
        assert reconfigurations > 2  # without the hold-down, flaps reach the plan
    name = "gpu_flapping" if hold else "gpu_flapping_no_hold_down"
    record(name, f"one GPU fails and recovers {flaps} times (xid79/recover, ~0.2 s apart); "
           f"controller.flap_hold_down_s={hold}",
           f"{reconfigurations} reconfigurations" + (" (one at the first failure, one after the "
                                                     "hold-down)" if hold else " (damping off)"),
           {"flaps": flaps, "failures_seen_in_etcd": failures_in_etcd,
            "reconfigurations": reconfigurations, "last_recovery_to_restore_ms": released_ms})
