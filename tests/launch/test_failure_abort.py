"""NCCL-safe recovery through the plan stream, on gloo: a rank is frozen (SIGSTOP: its
sockets stay open, so no transport error reaches its peers) and its GPU fails (XID 79
through its agent). The survivors are blocked in a collective with it; the controller's
next plan generation (cause ``gpu_failed``) drops the GPU, and the plan stream makes them
abort their groups (``hooks.abort``, after its 2 s grace: gloo's connections shut down, as
NCCL's communicators are aborted) and go on with the new plan. Their watchdog is far longer than
the test waits, tpflex-run's beat timeout and the controller's too: only the plan stream
can get them out."""

from __future__ import annotations

import os
import signal

import pytest
from tpflex_proto import agent_pb2, agent_pb2_grpc
from tpflex_trainer.demo.cluster import DemoCluster, DemoPorts

from tests.e2e.support import free_base_port
from tests.launch.demo_job import RACKS, kill_launchers, read_records, start_job, wait_rank_step
from tests.launch.support import base_env
from tests.support.wait import wait_until

STEPS, VICTIM = 14, 5  # rank 5: node-1, GPU 1
WATCHDOG_S, SURVIVORS_WAIT_S = 400, 120  # the survivors must be out long before their watchdog


class _Cluster(DemoCluster):
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        if name.startswith("controller"):  # no soft failure for the frozen rank's silence
            env = {**(env or {}), "TPFLEX_LIVENESS__BEAT_TIMEOUT_S": "3600"}
        super()._spawn(name, argv, env)


def _records(path) -> list[dict]:
    return read_records(path, partial_ok=True)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_survivors_blocked_on_a_frozen_rank_leave_through_the_failure_plan(tmp_path):
    cluster = _Cluster(DemoPorts(free_base_port()), RACKS, tmp_path / "cluster")
    out = tmp_path / "steps.jsonl"
    env = base_env(TPFLEX_DEMO_OUT=str(out), TPFLEX_DEMO_STEPS=str(STEPS), TPFLEX_DEMO_STEP_MIN_S="0.3",
                   GLOO_SOCKET_IFNAME="lo", TPFLEX_LOG_LEVEL="WARNING", TPFLEX_WATCHDOG_S=str(WATCHDOG_S),
                   TPFLEX_COLLECTIVE_TIMEOUT_S=str(2 * WATCHDOG_S), TPFLEX_PLAN_WAIT_S="120")
    launchers = []
    try:
        cluster.start()
        _, launchers = start_job(cluster, tmp_path, "abort", env, ["--beat-timeout-s", "3600"])
        victim = wait_rank_step(out, VICTIM, 2)
        os.kill(victim["pid"], signal.SIGSTOP)  # alive, sockets open: its peers block on it
        with cluster.agent_channel("node-1") as ch:
            agent_pb2_grpc.AgentStub(ch).InjectFault(agent_pb2.InjectFaultRequest(index=1, kind="xid79"), timeout=5)
        done = wait_until(lambda: (lambda d: d if len(d) == 7 else None)(
            [r for r in _records(out) if r["kind"] == "done"]), SURVIVORS_WAIT_S, "the survivors' last step")
        records = _records(out)
    finally:
        kill_launchers(launchers)
        for pid in {r["pid"] for r in _records(out)}:  # ranks run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cluster.stop()
    rank_logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("node-*/*.log"))
    # every survivor finished the job, none through its watchdog
    assert sorted(r["rank"] for r in done) == [r for r in range(8) if r != VICTIM]
    assert all(r["step"] == STEPS and r["watchdog_fired"] == 0 for r in done), done
    # they left the frozen rank's round through the failure generation's abort
    assert "(gpu_failed) drops node-1:1" in rank_logs, rank_logs[-3000:]
    assert "gloo connections shut down" in rank_logs
    # and trained on without the failed GPU: the degraded replica at TP 3, the same steps
    failure_gen = min(r["generation"] for r in records if r["kind"] == "applied" and r["after_failure"])
    after = [r for r in records if r["kind"] == "step" and r["generation"] >= failure_gen]
    assert {r["rank"] for r in after} == {r for r in range(8) if r != VICTIM}
    assert {r["tp"] for r in after if r["rank"] >= 4} == {3}
    steps = {rank: sorted({r["step"] for r in records if r["kind"] == "step" and r["rank"] == rank})
             for rank in range(8) if rank != VICTIM}
    assert all(s == list(range(STEPS)) for s in steps.values()), steps
