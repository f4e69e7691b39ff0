"""The demo's story, as a function the CLI, the end-to-end test and the recovery benchmark
share: train at TP 4+4; a GPU of rack 1 fails (XID 79 through its agent, and its rank's
process dies with it); the controller re-plans (4+3, rack 1 boosted); the job reshards
in-process and keeps training; the GPU is repaired and the job returns to 4+4.

With pipeline stages (``pp=2``): 4 racks x 2 GPUs, 2 replicas x PP 2 x TP 2; a GPU of
stage 1 of replica 1 fails, only that stage drops to TP 1 (the other stage of the replica
and the other replica keep their layouts), and returns to TP 2 after the repair.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, planstore, types_pb2

from tpflex_trainer.demo.cluster import DemoCluster, DemoPorts, RackLayout, check_ports_free
from tpflex_trainer.demo.launcher import JobLauncher, demo_job_spec, worker_preload, zygote_for
from tpflex_trainer.demo.model import LOCAL_BATCH, demo_model
from tpflex_trainer.launch.zygote import Zygote

JOB = "demo-gpt"
RACKS = (RackLayout("rack-0", "node-0", 4), RackLayout("rack-1", "node-1", 4))
FAILED_GPU = ("node-1", 2)
FAILURE_GENERATION, REPAIR_GENERATION = 2, 3  # the plans the story's failure and repair cause


@dataclass(frozen=True)
class Topology:
    """The demo cluster and job: racks (one per stage of each replica, in replica then
    stage order), stages per replica, and the GPU that fails."""

    racks: tuple[RackLayout, ...]
    stages: int
    failed_gpu: tuple[str, int]

    @property
    def failed_rack(self) -> str:
        return next(r.name for r in self.racks if r.node == self.failed_gpu[0])

    def describe(self) -> str:
        tp = self.racks[0].gpus
        n = len(self.racks)
        pp = f" x PP {self.stages}" if self.stages > 1 else ""
        return f"{n // self.stages} replicas{pp} x TP {tp} = {n * tp} gloo processes"


TOPOLOGIES = {
    1: Topology(RACKS, 1, FAILED_GPU),
    2: Topology(tuple(RackLayout(f"rack-{i}", f"node-{i}", 2) for i in range(4)), 2, ("node-3", 1)),
}


def format_degrees(degrees: list) -> str:
    """4+3, or with stages each replica's stage degrees: 2/2+2/1."""
    return "+".join("/".join(map(str, d)) if isinstance(d, list) else str(d) for d in degrees)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StoryConfig:
    workdir: Path
    base_port: int = DemoPorts.base
    steps: int = 160
    fail_at_step: int = 30
    repair_at_step: int = 90
    policy: str = "ntp-pw"
    phase_timeout_s: float = 60.0
    # the workers checkpoint every this many steps into workdir/checkpoints (0 = never): the
    # fallback when a failure tears a step (survivors at two steps, some units current
    # only on the dead rank) and what a whole-job restart loads
    checkpoint_every: int = 10
    worker_env: dict[str, str] = field(default_factory=dict)
    # everything over TLS (mTLS between services, to the plan stream and the agents), etcd
    # with auth, REST with tokens: see DemoCluster
    tls: bool = False
    # a Hugging Face model directory instead of the built-in GPT
    model_dir: str | None = None
    pp: int = 1  # pipeline stages per replica (see TOPOLOGIES)
    # the job holds at step repair_at_step + 1 until the plan of the repair arrived (the
    # worker's TPFLEX_DEMO_HOLD_FILE), so that a short, fast job cannot finish before the
    # controller re-plans the repaired GPU in; off for drivers that script their own phases
    hold_for_repair: bool = True
    # fork the ranks from a zygote that imported the worker's modules once (faster starts
    # and the repaired GPU's process; demo/launcher.worker_preload)
    preload: bool = False

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoints"


@dataclass
class StoryRun:
    """What happened, gathered while the story ran (the summary is computed from it)."""

    t_fail: float = 0.0
    t_repair: float = 0.0
    plans: dict[int, types_pb2.Plan] = field(default_factory=dict)
    events: list[types_pb2.Event] = field(default_factory=list)
    caps_degraded: dict[int, float] = field(default_factory=dict)  # rack 1 GPU -> applied cap (W)
    caps_repaired: dict[int, float] = field(default_factory=dict)
    acks: dict[int, int] = field(default_factory=dict)  # rank -> generation acked
    records: list[dict] = field(default_factory=list)
    dp_drop_ratio: float = 0.0
    ntp_ratio_degraded: float = 0.0
    started_after_repair: list[tuple[str, int]] = field(default_factory=list)
    workdir: Path | None = None
    failed_rack: str = "rack-1"


class Story:
    def __init__(self, config: StoryConfig, progress: Progress = lambda _: None) -> None:
        self.config = config
        self.progress = progress
        self.ports = DemoPorts(config.base_port)
        self.topo = TOPOLOGIES[config.pp]
        self.cluster = DemoCluster(self.ports, self.topo.racks, config.workdir / "cluster", tls=config.tls)
        self.launcher: JobLauncher | None = None
        self._zygote: Zygote | None = None  # the ranks' zygote until the launcher takes it
        self.run = StoryRun(workdir=config.workdir, failed_rack=self.topo.failed_rack)

    # ------------------------------------------------------------------ phases
    def start(self) -> None:
        racks = self.topo.racks
        check_ports_free(self.ports.all(len(racks)))
        if self.config.preload:  # it imports torch while the cluster starts
            self._zygote = zygote_for(worker_preload(self.config.model_dir), wait=False)
        secured = " with TLS/mTLS, etcd auth and REST tokens" if self.config.tls else ""
        self.progress(f"starting etcd, tpflex-controller and {len(racks)} simulated agents "
                      f"({len(racks)} racks x {racks[0].gpus} GPUs){secured}")
        self.cluster.start()
        spec = demo_job_spec(JOB, [(r.name, r.node, r.gpus) for r in racks], LOCAL_BATCH,
                             demo_model(self.config.model_dir, racks[0].gpus).units, policy=self.config.policy,
                             stages=self.topo.stages)
        env = {**self.cluster.trainer_env(), **self.cluster.register_job(spec), **self.config.worker_env}
        if self.config.hold_for_repair:
            hold = self.config.workdir / "hold"
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.write_text(f"{self.config.repair_at_step + 1} {REPAIR_GENERATION}\n")
            env["TPFLEX_DEMO_HOLD_FILE"] = str(hold)
        if self.config.model_dir:
            env["TPFLEX_DEMO_MODEL"] = str(self.config.model_dir)
        if self.config.checkpoint_every:
            self.config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            env = {"TPFLEX_CHECKPOINT_DIR": str(self.config.checkpoint_dir),
                   "TPFLEX_CHECKPOINT_EVERY": str(self.config.checkpoint_every), **env}
        self.launcher = JobLauncher(spec, self.config.workdir, self.ports.store,
                                    self.cluster.trainer_endpoint, self.config.steps, env=env, zygote=self._zygote)
        self._zygote = None
        self.progress(f"starting the training job: {self.topo.describe()}")
        self.launcher.start_all()

    def play(self) -> StoryRun:
        c = self.config
        node = self.topo.failed_gpu[0]
        self.wait_step(c.fail_at_step, "training at full TP")
        self.fail_gpu()
        self.wait_plan(FAILURE_GENERATION)
        self.wait_generation_training(FAILURE_GENERATION)
        self.run.caps_degraded = self.applied_caps(node)
        self.run.dp_drop_ratio = self.dry_run_ratio("dp-drop")
        self.run.ntp_ratio_degraded = self.run.plans[FAILURE_GENERATION].expected_throughput_ratio
        self.wait_step(c.repair_at_step, "training at reduced TP")
        self.repair_gpu()
        repaired = self.wait_plan(REPAIR_GENERATION)
        self.run.started_after_repair = self.launcher.start_missing(repaired)
        self.wait_generation_training(REPAIR_GENERATION)
        self.run.caps_repaired = self.applied_caps(node)
        self.wait_done()
        self.collect()
        return self.run

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()
        if self._zygote is not None:  # stopped before the launcher took it
            self._zygote.close()
            self._zygote = None
        self.cluster.stop()

    # ------------------------------------------------------------------ actions
    def fail_gpu(self) -> None:
        node, index = self.topo.failed_gpu
        self.progress(f"FAILURE: GPU {node}:{index} falls off the bus (XID 79); its rank dies with it")
        self.run.t_fail = time.time()
        self.launcher.kill_rank(self.topo.failed_gpu)
        self.inject(node, index, "xid79")

    def repair_gpu(self) -> None:
        node, index = self.topo.failed_gpu
        self.progress(f"REPAIR: GPU {node}:{index} is back; the launcher starts a process for it")
        self.run.t_repair = time.time()
        self.inject(node, index, "recover")

    def inject(self, node: str, index: int, kind: str) -> None:
        with self.cluster.agent_channel(node) as ch:
            agent_pb2_grpc.AgentStub(ch).InjectFault(
                agent_pb2.InjectFaultRequest(index=index, kind=kind), timeout=5)

    def applied_caps(self, node: str) -> dict[int, float]:
        with self.cluster.agent_channel(node) as ch:
            resp = agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
        return {g.index: g.power_limit_w for g in resp.gpus}

    def dry_run_ratio(self, policy: str) -> float:
        req = urllib.request.Request(
            f"{self.cluster.rest_url}/v1/jobs/{JOB}/dry-run", method="POST",
            data=json.dumps({"policy": policy}).encode(),
            headers={"Content-Type": "application/json", **self.cluster.rest_headers()})
        with urllib.request.urlopen(req, timeout=10, context=self.cluster.ssl_context()) as r:
            body = json.loads(r.read())
        return float(body["plan"]["expected_throughput_ratio"])

    # ------------------------------------------------------------------ waiting
    def _until(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.config.phase_timeout_s
        last_note = 0.0
        while not cond():
            self.cluster.check_alive()
            failed = self.launcher.failed_ranks() if self.launcher else {}
            if failed:
                tails = "".join(f"\n--- rank {node}:{index} (exit {code}) ---\n{self.launcher.log_tail((node, index))}"
                                for (node, index), code in sorted(failed.items()))
                raise RuntimeError(f"training ranks failed {failed}; logs in {self.config.workdir}{tails}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {self.config.phase_timeout_s:.0f}s; "
                                   f"logs in {self.config.workdir}")
            if time.monotonic() - last_note > 2.0:
                last_note = time.monotonic()
                self.progress(self.status_line())
            time.sleep(0.05)

    def status_line(self) -> str:
        steps = [r for r in self.launcher.records() if r["kind"] == "step"]
        if not steps:
            return "  waiting for the first step"
        last = max(steps, key=lambda r: r["step"])
        recent = sorted({r["step"]: r for r in steps}.values(), key=lambda r: r["t"])[-10:]
        rate = 0.0
        if len(recent) > 1 and recent[-1]["t"] > recent[0]["t"]:
            rate = sum(r["global_batch"] for r in recent[1:]) / (recent[-1]["t"] - recent[0]["t"])
        degrees = format_degrees(last["degrees"])
        return (f"  step {last['step']:4d}  TP {degrees:<5}  generation {last['generation']}  "
                f"loss {last['loss']:.4f}  {rate:6.1f} samples/s")

    def wait_step(self, step: int, what: str) -> None:
        self.progress(f"{what} ...")
        self._until(lambda: any(r["kind"] == "step" and r["step"] >= step
                                for r in self.launcher.records()), f"{what} until step {step}")

    def wait_plan(self, generation: int) -> types_pb2.Plan:
        def committed() -> bool:
            plan = planstore.read_plan(self.cluster.etcd, JOB)
            if plan is None:
                return False
            if plan.generation >= generation:
                self.run.plans.setdefault(plan.generation, plan)
                return True
            return False

        self._until(committed, f"plan generation {generation}")
        plan = self.run.plans[max(self.run.plans)]
        degrees = format_degrees([
            [st.tp_degree for st in sorted(r.stages, key=lambda st: st.spec_stage)] if len(r.stages) > 1
            else r.tp_degree for r in sorted(plan.replicas, key=lambda r: r.index)])
        caps = ", ".join(f"{c.gpu.node}:{c.gpu.index}={c.cap_w:.0f}W" for c in plan.power_caps) or "nominal"
        self.progress(f"controller committed plan generation {plan.generation}: TP {degrees}, caps {caps}")
        for reason in plan.reasons:
            self.progress(f"    reason: {reason}")
        return plan

    def wait_generation_training(self, generation: int) -> None:
        self._until(lambda: any(r["kind"] == "step" and r["generation"] >= generation
                                for r in self.launcher.records()),
                    f"training at generation {generation}")
        self.progress(f"job resharded and training again at generation {generation}")

    def wait_done(self) -> None:
        self.progress(f"training to step {self.config.steps} ...")
        self._until(self.launcher.all_done, "all ranks finished")

    def collect(self) -> None:
        etcd = self.cluster.etcd
        kvs, _ = etcd.get_prefix(keys.EVENTS)
        self.run.events = [codec.decode(types_pb2.Event, kv.value, kv.key) for kv in kvs]
        acks, _ = etcd.get_prefix(keys.job_acks(JOB))
        for kv in acks:
            ack = codec.decode(types_pb2.Ack, kv.value, kv.key)
            self.run.acks[ack.rank] = ack.generation
        self.run.records = self.launcher.records()
