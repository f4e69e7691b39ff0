"""The chaos soak's cluster and faults (``bench/soak.py`` runs them and measures): the
demo cluster with a 3-member etcd and two controllers, the job on two ``tpflex-run``
nodes, the workers' records, and one method per fault kind (see ``bench/soak.py``)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tpflex_controller.devtools.etcd_server import EtcdCluster
from tpflex_controller.devtools.ports import free_ports
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd
from tpflex_trainer.demo.cluster import (
    DemoCluster,
    DemoPorts,
    RackLayout,
    check_ports_free,
)
from tpflex_trainer.demo.launcher import demo_job_spec, worker_preload
from tpflex_trainer.demo.model import DEMO_MODEL
from tpflex_trainer.hooks.config import write_spec

from bench.soak_oracle import window_dumped
from tests.support.wait import wait_until

JOB, LOCAL_BATCH = "soak", 4
RACKS = (RackLayout("rack-0", "node-0", 4), RackLayout("rack-1", "node-1", 4))
ALL_GPUS = {(r.node, i) for r in RACKS for i in range(r.gpus)}
KINDS = ("rank_sigkill", "rank_hang", "xid79", "agent_freeze", "controller_leader_kill", "etcd_member_kill")
BACKOFF_MAX_S = 2.0  # tpflex-run's restart backoff cap (its default, 30 s, is for crash loops)
SETTLE_S = 4.0  # after a fault: > the agents' lease (2 s) and tpflex-run's beat timeout (3 s)
STARTED = re.compile(r"rank started node=(\S+) local_rank=\d+ gpu=(\d+) pid=(\d+)")


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_demo_ports(tries: int = 50) -> DemoPorts:
    rng = random.Random()
    for _ in range(tries):
        ports = DemoPorts(rng.randrange(20000, 32000, 20))
        try:
            check_ports_free(ports.all(len(RACKS)))
            return ports
        except OSError:
            continue
    raise RuntimeError("no free port range for the soak cluster")


class SoakCluster(DemoCluster):
    """The demo's cluster with a 3-member etcd and a second controller; remembers how each
    service was started so a killed one can be started again."""

    def _start_etcd(self) -> None:
        self.etcd_server = EtcdCluster(3, self.workdir / "etcd").start()

    @property
    def etcd_endpoint(self) -> str:
        return ",".join(self.etcd_server.endpoints)

    def _etcd_client(self) -> Etcd:
        return Etcd(self.etcd_server.endpoints, timeout=2.0)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        if name.startswith("controller"):  # the soak's faults land on the same GPU at will: no drains
            env = {**(env or {}), "TPFLEX_LIVENESS__MAX_SOFT_FAILURES": "1000"}
        self.__dict__.setdefault("argv", {})[name] = (argv, env)
        super()._spawn(name, argv, env)

    def start(self) -> None:
        super().start()
        argv, env = self.argv["controller"]
        rest, trainer = free_ports(2)
        self.trainer2 = trainer
        swap = {f"127.0.0.1:{self.ports.rest}": f"127.0.0.1:{rest}",
                f"127.0.0.1:{self.ports.trainer}": f"127.0.0.1:{trainer}", "demo-controller": "controller-2"}
        self._spawn("controller-2", [swap.get(a, a) for a in argv], env)

    @property
    def trainer_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.trainer},127.0.0.1:{self.trainer2}"

    def respawn(self, name: str) -> None:
        argv, env = self.argv[name]
        self._spawn(name, argv, env)

    def leader(self) -> str:
        kv = self.etcd.get(keys.LEADER)
        ident = codec.decode(types_pb2.LeaderRecord, kv.value).id if kv is not None else ""
        return "controller-2" if "controller-2" in ident else "controller"

    def plan(self) -> tuple[int, set[tuple[str, int]]]:
        """The job's plan generation and the GPUs it uses (each generation seen is kept in
        ``plans``: the same-layout replay applies them)."""
        plan = planstore.read_plan(self.etcd, JOB)  # header + per-replica parts
        if plan is None:
            return 0, set()
        self.__dict__.setdefault("plans", {}).setdefault(plan.generation, plan)
        return plan.generation, {(g.node, g.index) for rep in plan.replicas if rep.tp_degree
                                 for st in rep.stages for g in st.gpus}

    def plan_gpus(self) -> set[tuple[str, int]]:
        return self.plan()[1]

    def inject(self, node: str, index: int, kind: str) -> None:
        with self.agent_channel(node) as ch:
            agent_pb2_grpc.AgentStub(ch).InjectFault(agent_pb2.InjectFaultRequest(index=index, kind=kind), timeout=5)


class Records:
    """The workers' JSON lines, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.all = path, 0, []

    def poll(self) -> list[dict]:
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
            end = chunk.rfind("\n") + 1
            self.offset += len(chunk[:end].encode())
            self.all.extend(json.loads(line) for line in chunk[:end].splitlines() if line)
        return self.all

    def progress(self) -> int:
        """The highest step any rank completed (-1 before the first)."""
        return max((r["step"] for r in self.poll() if r["kind"] == "step"), default=-1)


def wait(cond, timeout: float, what: str, interval: float = 0.1):
    """tests/support/wait.py's ``wait_until``, failing with the soak's own TimeoutError."""
    return wait_until(cond, timeout, what, interval,
                      fail=lambda: TimeoutError(f"soak: {what} not within {timeout:.0f}s"))


def run_job(cluster: DemoCluster, work: Path, steps: int, *, stop_file: Path | None, checkpoints: bool,
            pace_s: float = 0.0, preload: bool = False, checkpoint_every: int = 200, dumps: Path | None = None):
    """``dumps``: the ranks dump the job's state around each generation's start there
    (``demo/dumps.py``, for ``bench/soak_oracle.py``)."""
    spec = demo_job_spec(JOB, [(r.name, r.node, r.gpus) for r in RACKS], LOCAL_BATCH, DEMO_MODEL.unit_counts())
    write_spec(spec, work / "job.json")
    env = {**os.environ, "TPFLEX_DEMO_OUT": str(work / "steps.jsonl"), "TPFLEX_DEMO_STEPS": str(steps),
           "TPFLEX_DEMO_FINAL_DIR": str(work / "final"), "GLOO_SOCKET_IFNAME": "lo",
           "TPFLEX_LOG_LEVEL": os.environ.get("TPFLEX_LOG_LEVEL", "WARNING"), "TPFLEX_COLLECTIVE_TIMEOUT_S": "60", "TPFLEX_PLAN_WAIT_S": "60",
           "TPFLEX_DEMO_DIGESTS": "1"}
    if stop_file is not None:
        env["TPFLEX_DEMO_STOP_FILE"] = str(stop_file)
    if pace_s > 0:
        env["TPFLEX_DEMO_STEP_MIN_S"] = str(pace_s)
    if checkpoints:
        env.update(TPFLEX_CHECKPOINT_DIR=str(work / "ckpt"), TPFLEX_CHECKPOINT_EVERY=str(checkpoint_every))
    if dumps is not None:
        env["TPFLEX_DEMO_DUMP_DIR"] = str(dumps)
    for var in ("CUDA_VISIBLE_DEVICES", "TPFLEX_CONTROLLER", "TPFLEX_JOB", "TPFLEX_JOB_SPEC", "TPFLEX_STORE"):
        env.pop(var, None)
    procs = []
    for r in RACKS:
        procs.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "tpflex-run"), "--controller", cluster.trainer_endpoint,
             "--job-spec", str(work / "job.json"), "--node", r.node, "--log-dir", str(work / "ranks"),
             "--backoff-s", "0.5", "--backoff-max-s", str(BACKOFF_MAX_S), "--max-restarts", "1000",
             "--beat-timeout-s", "3", "--register-token-file", str(cluster.admin_token_file),
             *(["--preload", ",".join(worker_preload())] if preload else []), "--",
             sys.executable, "-m", "tpflex_trainer.demo.worker"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(work / f"{r.node}.log", "wb"), start_new_session=True))
    return spec, procs


class Chaos:
    def __init__(self, cluster: SoakCluster, work: Path, records: Records, rng: random.Random,
                 kinds: tuple[str, ...] = KINDS) -> None:
        self.cluster, self.work, self.records, self.rng, self.kinds = cluster, work, records, rng, kinds
        self.faults: list[dict] = []
        self.due: list[str] = []  # this round's kinds, in a random order
        self.dumps = work / "dumps"  # the ranks' state dumps (run_job's ``dumps``)

    def next_kind(self) -> str:
        """Every kind once per round, each round in a random order: a short soak still
        injects every kind."""
        if not self.due:
            self.due = self.rng.sample(self.kinds, len(self.kinds))
        return self.due.pop()

    def rank_pids(self) -> dict[tuple[str, int], int]:
        """The newest process of each GPU's rank, from the launchers' logs."""
        pids: dict[tuple[str, int], int] = {}
        for r in RACKS:
            for m in STARTED.finditer((self.work / f"{r.node}.log").read_text(errors="replace")):
                pids[(m.group(1), int(m.group(2)))] = int(m.group(3))
        return pids

    def training_rank(self) -> tuple[tuple[str, int], int]:
        active = {r["pid"] for r in self.records.poll()[-400:] if r["kind"] == "step"}
        choices = [(gpu, pid) for gpu, pid in self.rank_pids().items() if pid in active]
        return self.rng.choice(sorted(choices))

    def healthy(self, after: float) -> bool:
        """Every GPU in the plan, 3 steps completed under that plan generation by all 8
        ranks since ``after`` (a fault's end plus a settling time: the agents' lease, the
        launchers' beat timeout), and the generation's oracle window dumped (its first
        round, or a later one if a fault cut that short: ``soak_oracle.window_dumped``)."""
        if time.time() < after:
            return False
        generation, gpus = self.cluster.plan()
        if gpus != ALL_GPUS:
            return False
        done: dict[int, set[int]] = {}
        for r in self.records.poll()[-400:]:
            if r["kind"] == "step" and r["generation"] == generation and r["t"] > after:
                done.setdefault(r["step"], set()).add(r["rank"])
        return sum(1 for ranks in done.values() if len(ranks) == 8) >= 3 and window_dumped(self.dumps, generation)

    def inject(self) -> dict:
        kind = self.next_kind()
        fault = {"kind": kind, "at": time.time()}
        getattr(self, kind)(fault)
        fault["done_at"] = time.time()
        self.faults.append(fault)
        log(f"fault {len(self.faults)} {kind} {fault.get('what', '')}")
        return fault

    def rank_sigkill(self, fault: dict) -> None:
        gpu, pid = self.training_rank()
        fault["what"] = f"{gpu} pid {pid}"
        os.kill(pid, signal.SIGKILL)

    def rank_hang(self, fault: dict) -> None:
        gpu, pid = self.training_rank()
        fault["what"] = f"{gpu} pid {pid} frozen"
        os.kill(pid, signal.SIGSTOP)  # tpflex-run kills it after --beat-timeout-s

    def xid79(self, fault: dict) -> None:
        (node, index), pid = self.training_rank()
        fault["what"] = f"{node}:{index}"
        self.cluster.inject(node, index, "xid79")
        os.kill(pid, signal.SIGKILL)  # its rank dies with it (a CUDA error, at once)
        wait(lambda: (node, index) not in self.cluster.plan_gpus(), 30, "the re-plan without the failed GPU")
        degraded = self.cluster.plan()[0]
        time.sleep(self.rng.uniform(2, 6))  # the GPU stays out of the job this long
        # and until the degraded layout trained the oracle's window (else a step or two in it
        # would be a layout change nobody could check)
        wait(lambda: window_dumped(self.dumps, degraded), 120, "the degraded layout's oracle window")
        self.cluster.inject(node, index, "recover")

    def agent_freeze(self, fault: dict) -> None:
        node = self.rng.choice([r.node for r in RACKS])
        proc = self.cluster.procs[f"agent-{node}"]
        hold = self.rng.uniform(0.5, 1.5)  # within its lease: the node stays in the job
        fault["what"] = f"{node} {hold:.1f}s"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(hold)
        os.kill(proc.pid, signal.SIGCONT)

    def controller_leader_kill(self, fault: dict) -> None:
        name = self.cluster.leader()
        fault["what"] = name
        proc = self.cluster.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        wait(lambda: self.cluster.leader() != name or self.cluster.etcd.get(keys.LEADER) is None, 30,
             "the old leader's key to go")
        time.sleep(1.0)
        self.cluster.respawn(name)

    def etcd_member_kill(self, fault: dict) -> None:
        i = self.rng.randrange(3)
        fault["what"] = f"member m{i}"
        self.cluster.etcd_server.members[i].kill()
        time.sleep(self.rng.uniform(1, 4))
        self.cluster.etcd_server.restart_member(i)


def record_plans(cluster: SoakCluster, stop: threading.Event) -> None:
    """Read the job's plan every 0.1 s, so that every generation is kept (``plan``)."""
    while not stop.wait(0.1):
        try:
            cluster.plan()
        except Exception as exc:  # noqa: BLE001 -- an etcd member down: the next read
            log(f"plan not read: {type(exc).__name__}")
