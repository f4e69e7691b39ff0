"""A small real fleet for the fault scenarios: racks in etcd, real ``tpflex-agent``
processes (simulated GPUs) registering themselves, real ``tpflex-controller`` processes,
and ``ControlClient`` trainers (one per rank) that ack every plan they receive.

Measured figures go to ``build/reliability/<scenario>.json`` (git-ignored);
``tests/reliability/render.py`` turns them into the table of docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from tpflex_controller import synthetic
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd, EtcdError
from tpflex_trainer.hooks.control import ControlClient, ControlConfig

from tests.agent.support import AgentProcess, wait_until
from tests.controller import controller_harness as harness
from tests.controller.controller_harness import ControllerProc

ROOT = Path(__file__).resolve().parents[2]
FIGURES_DIR = ROOT / "build" / "reliability"
SIM_TDP_W = 700.0
ADMIN_TOKEN = "fleet-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def record(scenario: str, injected: str, checked: str, figures: dict) -> None:
    """Write one scenario's measured figures for docs/reliability.md."""
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    row = {"scenario": scenario, "injected": injected, "checked": checked, "figures": figures,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (FIGURES_DIR / f"{scenario}.json").write_text(json.dumps(row, indent=1) + "\n")


class RankClient(ControlClient):
    """A trainer rank: records every plan generation it is handed and acks it."""

    def __init__(self, endpoints: list[str], job: str, rank: int) -> None:
        super().__init__(ControlConfig(endpoints=tuple(endpoints), job=job, rank=rank,
                                       call_timeout_s=1.0, backoff_max_s=0.5))
        self.generations: list[int] = []

    def _offer(self, plan: types_pb2.Plan) -> None:
        before = self.latest_plan()
        super()._offer(plan)
        latest = self.latest_plan()
        if latest is not None and latest is not before:
            self.generations.append(latest.generation)
            self.ack(latest.generation)


class Fleet:
    """``racks`` racks of ``nodes`` agents x ``gpus`` simulated GPUs, one job over them."""

    def __init__(self, endpoints: list[str], tmp: Path, *, racks: int = 2, nodes: int = 2,
                 gpus: int = 2, agent_ttl: int = 5, hold_down_s: float = 0.0) -> None:
        self.endpoints, self.tmp = endpoints, tmp
        self.etcd = Etcd(endpoints, timeout=2.0)
        self.racks = [synthetic.rack(f"rack{i}", nodes, gpus, tdp_w=SIM_TDP_W, min_w=200.0,
                                     max_w=SIM_TDP_W * 1.3) for i in range(racks)]
        self.gpus, self.agent_ttl, self.hold_down_s = gpus, agent_ttl, hold_down_s
        self.agents: dict[str, AgentProcess] = {}
        self.controllers: dict[str, ControllerProc] = {}
        self.ranks: list[RankClient] = []
        self.job = "job1"

    # ---- start ----

    def start_agents(self) -> None:
        for r in self.racks:
            self.etcd.put(keys.rack(r.name), codec.encode(r))
        with ThreadPoolExecutor(8) as pool:
            procs = pool.map(self._start_agent, [(r.name, n) for r in self.racks for n in r.nodes])
            for p in procs:
                self.agents[p.node] = p
        wait_until(lambda: len(self.etcd.get_prefix(keys.NODES)[0]) == len(self.agents), 15,
                   "every agent registered")

    def _start_agent(self, rack_node: tuple[str, str]) -> AgentProcess:
        rack, node = rack_node
        return AgentProcess([
            "--node", node, "--rack", rack, "--backend", "sim", "--sim-gpus", str(self.gpus),
            "--etcd", ",".join(self.endpoints), "--lease-ttl-s", str(self.agent_ttl),
            "--listen", "127.0.0.1:0", "--insecure", "--metrics-listen", "127.0.0.1:0",
            "--health-poll-s", "0.1", "--power-check-s", "0.5",
        ])

    def put_job(self) -> types_pb2.JobSpec:
        spec = synthetic.job(self.job, [r.name for r in self.racks], self.racks[0].domain_size)
        self.etcd.put(keys.job_spec(self.job), codec.encode(spec))
        return spec

    def start_controller(self, name: str, ttl: int = 2, ports: tuple[int, int] | None = None,
                         env: dict[str, str] | None = None) -> ControllerProc:
        """A controller process; it takes ``ADMIN_TOKEN`` as its admin REST token."""
        env = {"TPFLEX_CONTROLLER__FLAP_HOLD_DOWN_S": str(self.hold_down_s), **(env or {})}
        tokens = self.tmp / "admin.tokens"
        tokens.write_text(ADMIN_TOKEN + "\n")
        saved = harness.free_ports
        if ports is not None:  # a restart on the same REST and trainer ports
            harness.free_ports = lambda n: list(ports)
        try:
            proc = ControllerProc(self.endpoints, name, self.tmp, ttl=ttl, env=env,
                                  extra=["--admin-tokens-file", str(tokens)])
        finally:
            harness.free_ports = saved
        self.controllers[name] = proc
        return proc

    def start_ranks(self, endpoints: list[str]) -> list[RankClient]:
        n = len(self.racks) * self.racks[0].domain_size
        self.ranks = [RankClient(endpoints, self.job, r).start() for r in range(n)]
        return self.ranks

    @staticmethod
    def trainer_endpoint(proc: ControllerProc) -> str:
        return f"127.0.0.1:{proc.trainer_port}"

    # ---- faults ----

    def inject(self, node: str, index: int, kind: str) -> None:
        with grpc.insecure_channel(self.agents[node].grpc_address) as ch:
            agent_pb2_grpc.AgentStub(ch).InjectFault(
                agent_pb2.InjectFaultRequest(index=index, kind=kind), timeout=5)

    def push(self, node: str, generation: int, caps: dict[int, float]) -> None:
        """An ApplyPowerPlan straight to a node's agent (what anyone reaching its port can do)."""
        req = agent_pb2.ApplyPowerPlanRequest(generation=generation)
        for i, w in caps.items():
            req.caps.add(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=w)
        with grpc.insecure_channel(self.agents[node].grpc_address) as ch:
            agent_pb2_grpc.AgentStub(ch).ApplyPowerPlan(req, timeout=5)

    def agent_metric(self, node: str, name: str) -> float | None:
        return agent_metric(self.agents[node], name)

    def pause(self, node: str) -> None:
        os.kill(self.agents[node].proc.pid, signal.SIGSTOP)

    def resume(self, node: str) -> None:
        os.kill(self.agents[node].proc.pid, signal.SIGCONT)

    # ---- observations ----

    def _read(self, fn, *args):
        """A test-side etcd read that rides out an etcd leader change."""
        for attempt in range(50):
            try:
                return fn(*args)
            except EtcdError:
                if attempt == 49:
                    raise
                time.sleep(0.1)

    def plan(self) -> types_pb2.Plan | None:
        return self._read(planstore.read_plan, self.etcd, self.job)

    def history(self) -> list[int]:
        kvs, _ = self._read(self.etcd.get_prefix, keys.job_plan_histories(self.job))
        return sorted(int(kv.key.rsplit("/", 1)[-1]) for kv in kvs)

    def acks(self) -> dict[int, int]:
        kvs, _ = self._read(self.etcd.get_prefix, keys.job_acks(self.job))
        return {int(kv.key.rsplit("/", 1)[-1]): codec.decode(types_pb2.Ack, kv.value).generation
                for kv in kvs}

    def degrees(self) -> list[int]:
        p = self.plan()
        return [r.tp_degree for r in p.replicas] if p else []

    def expected_caps(self, plan: types_pb2.Plan) -> dict[tuple[str, int], float]:
        """The cap of every GPU the plan uses (a listed cap, else the rack's TDP)."""
        listed = {(c.gpu.node, c.gpu.index): c.cap_w for c in plan.power_caps}
        used = {(g.node, g.index) for rep in plan.replicas for st in rep.stages for g in st.gpus}
        return {g: listed.get(g, SIM_TDP_W) for g in used}

    def applied_caps(self) -> dict[tuple[str, int], float]:
        out = {}
        for node, a in self.agents.items():
            with grpc.insecure_channel(a.grpc_address) as ch:
                resp = agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
            out.update({(node, g.index): g.power_limit_w for g in resp.gpus})
        return out

    def caps_converged(self) -> bool:
        plan = self.plan()
        if plan is None:
            return False
        applied = self.applied_caps()
        return all(abs(applied.get(g, -1) - w) < 0.5 for g, w in self.expected_caps(plan).items())

    def ranks_at(self, generation: int) -> bool:
        acks = self.acks()
        return all(acks.get(r.config.rank) == generation for r in self.ranks)

    def wait_generation(self, generation: int, timeout: float = 15.0) -> types_pb2.Plan:
        wait_until(lambda: (p := self.plan()) is not None and p.generation >= generation, timeout,
                   f"plan generation {generation}")
        return self.plan()

    # ---- stop ----

    def close(self) -> None:
        for r in self.ranks:
            r.close()
        for a in self.agents.values():
            if a.proc.poll() is None:
                os.kill(a.proc.pid, signal.SIGCONT)
            a.kill()
        for c in self.controllers.values():
            c.kill()
        self.etcd.close()


def agent_metric(agent: AgentProcess, name: str) -> float | None:
    """One sample of an agent's /metrics (``name`` with its labels, as exposed)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def contiguous(generations: list[int]) -> bool:
    return generations == list(range(generations[0], generations[0] + len(generations))) if generations else False


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def ms(self) -> float:
        return round((time.monotonic() - self.t0) * 1000, 1)


def run_in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t
