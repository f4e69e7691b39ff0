"""The real stack the console is tested against: a real etcd, a ``tpflex-controller``
process and one simulated ``tpflex-agent`` process per rack (the demo's cluster helper),
and a job registered on it; faults are injected through the agents' gRPC API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tpflex_controller import synthetic
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys
from tpflex_trainer.demo.cluster import DemoCluster, DemoPorts, RackLayout

from tests.support.ports import free_base_port
from tests.support.wait import wait_until

JOB = "llama"


class ConsoleStack:
    def __init__(self, cluster: DemoCluster, job_racks: list[str], base_tp: int) -> None:
        self.cluster = cluster
        self.job_racks = job_racks
        self.base_tp = base_tp

    @property
    def url(self) -> str:
        return self.cluster.rest_url

    @property
    def admin_token(self) -> str:
        return self.cluster.admin_token

    @property
    def readonly_token(self) -> str:
        return self.cluster.readonly_token

    def node(self, rack: int) -> str:
        return self.cluster.racks[rack].node

    def inject(self, rack: int, index: int, kind: str, slow_factor: float = 0.0) -> None:
        """A fault (``xid79``, ``thermal``, ``slow``, ``recover``...) through the agent."""
        channel = self.cluster.agent_channel(self.node(rack))
        try:
            stub = agent_pb2_grpc.AgentStub(channel)
            stub.InjectFault(agent_pb2.InjectFaultRequest(index=index, kind=kind, slow_factor=slow_factor),
                             timeout=10)
        finally:
            channel.close()

    def plan(self) -> dict:
        r = httpx.get(f"{self.url}/v1/jobs/{JOB}/plan", headers=self.cluster.rest_headers(admin=False), timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_generation(self, generation: int, timeout: float = 20.0) -> dict:
        return wait_until(lambda: _at_least(self.plan(), generation), timeout,
                          f"plan generation {generation}")


def _at_least(plan: dict, generation: int) -> dict | None:
    return plan if plan["generation"] >= generation else None


@contextmanager
def console_stack(workdir: Path, racks: int = 2, gpus: int = 4) -> Iterator[ConsoleStack]:
    """``racks`` racks of one node x ``gpus`` GPUs, each with its simulated agent, and job
    ``llama`` with one replica per rack at TP ``gpus``; yields once plan generation 1 is
    committed."""
    layout = tuple(RackLayout(f"rack-{i}", f"rack-{i}-n0", gpus) for i in range(racks))
    cluster = DemoCluster(ports=DemoPorts(free_base_port(racks)), racks=layout, workdir=workdir)
    try:
        cluster.start()
        names = [r.name for r in layout]
        spec = synthetic.job(JOB, names, gpus, min_tp=max(1, gpus // 2))
        cluster.etcd.put(keys.job_spec(JOB), codec.encode(spec))
        stack = ConsoleStack(cluster, names, gpus)
        wait_until(lambda: _has_plan(stack), 30, "the first plan of the job")
        yield stack
    finally:
        cluster.stop()


def _has_plan(stack: ConsoleStack) -> bool:
    try:
        return stack.plan()["generation"] >= 1
    except httpx.HTTPStatusError:
        return False
