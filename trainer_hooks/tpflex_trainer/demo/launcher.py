"""The demo's job launcher: hosts the rendezvous store and one process per rank.

Like torchrun's agent it serves the c10d TCPStore the ranks rendezvous on; unlike it,
it does not restart the whole job when a rank dies: the survivors carry on in-process
(tpflex hooks), and a process is started for a GPU only when a plan uses that GPU and no
process runs there (a repaired GPU).

Unlike tpflex-run it does not report a rank's exit to the controller (``ReportRankExit``):
a reported exit is a soft failure, the controller keeps the GPU in the plan and the job
waits for the rank to rejoin, and this launcher never restarts a rank. The demo's ranks
die with their GPU (XID 79); the survivors learn it from the failure generation on the
plan stream (``hooks.abort``), blocked collectives included.

With ``preload`` the ranks are forked from a zygote that imported those modules once
(launch/zygote.py; :func:`worker_preload` lists the worker's): a rank's start, and a
repaired GPU's new process, skip the imports of torch (and transformers).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from tpflex_proto import types_pb2

from tpflex_trainer.demo.cluster import stop_process_groups
from tpflex_trainer.hooks.config import write_spec
from tpflex_trainer.launch.zygote import Entry, Zygote, ZygoteError, ZygoteProc

WORKER = "tpflex_trainer.demo.worker"

GpuKey = tuple[str, int]


def demo_job_spec(name: str, racks: Sequence[tuple[str, str, int]], local_batch: int,
                  units: dict[str, int], policy: str = "ntp-pw", stages: int = 1) -> types_pb2.JobSpec:
    """One rack per stage, ``stages`` consecutive racks per replica; ranks = the rack's
    GPUs in order."""
    base_tp = racks[0][2]
    replicas = len(racks) // stages
    spec = types_pb2.JobSpec(name=name, base_tp=base_tp, min_tp=1, policy=policy,
                             local_batch=local_batch, global_batch=local_batch * replicas)
    for r in range(replicas):
        rep = spec.replicas.add()
        for rack, node, gpus in racks[r * stages:(r + 1) * stages]:
            rep.stages.add(rack=rack, ranks=[types_pb2.GpuRef(node=node, index=i) for i in range(gpus)])
    for family, count in units.items():
        spec.units.add(name=family, count=count)
    return spec


def worker_preload(model_dir: str | Path | None = None) -> list[str]:
    """What the demo worker imports (torch, the hooks, the runtime), with a Hugging Face
    model the modelling module of its family too."""
    names = ["torch", "torch.distributed", "tpflex_trainer.demo.model", "tpflex_trainer.hooks.trainer",
             "tpflex_trainer.ntp.state", "tpflex_trainer.train.worker"]
    if model_dir:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
        names.append("tpflex_trainer.ntp.hf_adapter")
        if re.fullmatch(r"[a-z0-9_]+", model_type):
            names.append(f"transformers.models.{model_type}.modeling_{model_type}")
    return names


def zygote_for(preload: Sequence[str], wait: bool = True) -> Zygote:
    """A zygote for the demo's ranks, importing with their settings that do not vary by
    rank or run (started before the cluster, ``wait=False``, it imports meanwhile)."""
    return Zygote(sys.executable, preload, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                  wait=wait)


class JobLauncher:
    def __init__(self, spec: types_pb2.JobSpec, workdir: Path, store_port: int,
                 controller: str, steps: int, env: dict[str, str] | None = None,
                 preload: Sequence[str] = (), zygote: Zygote | None = None) -> None:
        """``preload``: fork the ranks from a zygote importing these modules; or ``zygote``,
        one already started (``zygote_for``), which the launcher then owns."""
        self.spec, self.workdir, self.steps = spec, workdir, steps
        self.controller = controller
        self.extra_env = env or {}
        self.spec_file = workdir / "job.json"
        self.out_file = workdir / "steps.jsonl"
        write_spec(spec, self.spec_file)
        self.store = dist.TCPStore("127.0.0.1", store_port, is_master=True,
                                   timeout=timedelta(seconds=60), wait_for_workers=False)
        self.store_address = f"127.0.0.1:{store_port}"
        self.procs: dict[GpuKey, subprocess.Popen | ZygoteProc] = {}
        self.zygote = zygote if zygote is not None else zygote_for(preload) if preload else None
        # False: ranks started from now on use Popen (the zygote keeps serving those it forked)
        self.fork_new_ranks = True

    def gpus(self) -> list[GpuKey]:
        return [(g.node, g.index) for rep in self.spec.replicas for st in rep.stages for g in st.ranks]

    def _env(self, rank: dict[str, str]) -> dict[str, str]:
        return {
            **os.environ, **self.extra_env,
            "TPFLEX_CONTROLLER": self.controller, "TPFLEX_JOB": self.spec.name,
            "TPFLEX_JOB_SPEC": str(self.spec_file), "TPFLEX_DEMO_OUT": str(self.out_file),
            "TPFLEX_DEMO_STEPS": str(self.steps), "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", **rank,
        }

    def start_rank(self, gpu: GpuKey) -> None:
        node, index = gpu
        env = self._env({"TPFLEX_NODE": node, "TPFLEX_GPU": str(index), "TPFLEX_STORE": self.store_address})
        command = [sys.executable, "-m", WORKER]
        with open(self.workdir / f"rank-{node}-{index}.log", "ab") as log:
            if self.zygote is not None and self.fork_new_ranks:
                try:
                    self.procs[gpu] = self.zygote.spawn(Entry("module", WORKER, ()), command, env,
                                                        stdout=log.fileno(), stderr=log.fileno())
                    return
                except ZygoteError as exc:  # as tpflex-run does: the ranks start without it
                    print(f"demo launcher: no zygote ({exc}); starting ranks with Popen", file=sys.stderr)
                    self.zygote.close()
                    self.zygote = None
            self.procs[gpu] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)

    def start_all(self) -> None:
        for gpu in self.gpus():
            self.start_rank(gpu)

    def kill_rank(self, gpu: GpuKey) -> None:
        """The GPU died: its process goes with it, without a goodbye."""
        proc = self.procs.get(gpu)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def running(self, gpu: GpuKey) -> bool:
        proc = self.procs.get(gpu)
        return proc is not None and proc.poll() is None

    def start_missing(self, plan: types_pb2.Plan) -> list[GpuKey]:
        """Start a process for every GPU the plan uses that has none (a repaired GPU)."""
        started = []
        for rep in plan.replicas:
            for stage in rep.stages:
                for g in stage.gpus:
                    key = (g.node, g.index)
                    if not self.running(key):
                        self.start_rank(key)
                        started.append(key)
        return started

    def restart_all(self, plan: types_pb2.Plan) -> list[GpuKey]:
        """A whole-job restart (what torchrun does after a failure): every process is
        killed, a new rendezvous round opens (a fresh store, so nothing of the old
        generations is reused) and a fresh process starts for every GPU ``plan`` uses; they
        get the current plan at start-up and load the latest checkpoint."""
        for gpu in list(self.procs):
            self.kill_rank(gpu)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                   timeout=timedelta(seconds=60), wait_for_workers=False)
        self.store_address = f"127.0.0.1:{self.store.port}"
        return self.start_missing(plan)

    def failed_ranks(self) -> dict[GpuKey, int]:
        """Processes that exited with an error (not killed by us, not finished cleanly)."""
        return {g: p.returncode for g, p in self.procs.items()
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL)}

    def log_tail(self, gpu: GpuKey, lines: int = 25) -> str:
        """The last ``lines`` lines of ``gpu``'s rank log (the traceback of a failed rank)."""
        node, index = gpu
        try:
            text = (self.workdir / f"rank-{node}-{index}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def all_done(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())

    def records(self) -> list[dict]:
        if not self.out_file.exists():
            return []
        out = []
        for line in self.out_file.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
        return out

    def stop(self) -> None:
        stop_process_groups(self.procs.values())
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
