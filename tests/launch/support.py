"""Running ``tpflex-run`` as a real subprocess with stand-in ranks (rank_child.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tpflex_proto import types_pb2
from tpflex_trainer.hooks.config import write_spec

from tests.support.wait import wait_until

RUN = str(Path(sys.executable).parent / "tpflex-run")
CHILD = [sys.executable, str(Path(__file__).parent / "rank_child.py")]
_FOREIGN = ("SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
            "KUBERNETES_SERVICE_HOST", "NODE_NAME", "CUDA_VISIBLE_DEVICES", "TPFLEX_CONTROLLER",
            "TPFLEX_JOB_SPEC", "TPFLEX_JOB", "TPFLEX_STORE", "FAKE_NVML_STATE")


def job_spec(path: Path, name: str = "run-job", nodes: dict[str, int] | None = None) -> Path:
    """A job spec with one replica per node, ranks = the node's GPUs 0..n-1."""
    spec = types_pb2.JobSpec(name=name, base_tp=max((nodes or {"n0": 4}).values()), min_tp=1,
                             policy="ntp-pw", local_batch=4, global_batch=4 * len(nodes or {"n0": 4}))
    for i, (node, gpus) in enumerate((nodes or {"n0": 4}).items()):
        spec.replicas.add().stages.add(rack=f"r{i}", ranks=[types_pb2.GpuRef(node=node, index=g)
                                                            for g in range(gpus)])
    spec.units.add(name="heads", count=8)
    write_spec(spec, path)
    return path


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN}
    env.update(extra)
    return env


class Launcher:
    def __init__(self, tmp: Path, args: list[str], env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> None:
        self.dir = tmp / "records"
        self.dir.mkdir(exist_ok=True)
        self.log_path = tmp / "tpflex-run.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [RUN, *args, "--", *(command or CHILD)],
            env=base_env(RECORDS_DIR=str(self.dir), **(env or {})),
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp)

    def records(self, local: int) -> list[dict]:
        path = self.dir / f"rank-{local}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def events(self, local: int, event: str) -> list[dict]:
        return [r for r in self.records(local) if r["event"] == event]

    def wait_started(self, counts: dict[int, int], timeout: float = 30.0) -> dict[int, list[dict]]:
        """Wait until local rank r has started ``counts[r]`` times; its start records."""
        wait_until(lambda: all(len(self.events(r, "start")) >= n for r, n in counts.items()), timeout,
                   f"rank starts {counts}; launcher log:\n{self.log()}")
        return {r: self.events(r, "start") for r in counts}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
