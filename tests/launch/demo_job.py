"""The demo job on two ``tpflex-run`` nodes (4 ranks each) against a real demo cluster,
as the rank-failure tests start it (test_rank_liveness, test_failure_abort): the spec,
the launchers, a rank's progress and the clean-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tpflex_trainer.demo.cluster import DemoCluster, RackLayout
from tpflex_trainer.demo.launcher import demo_job_spec, worker_preload
from tpflex_trainer.demo.model import DEMO_MODEL
from tpflex_trainer.hooks.config import write_spec

from tests.launch.support import RUN
from tests.support.wait import wait_until

LOCAL_BATCH = 4
RACKS = (RackLayout("rack-0", "node-0", 4), RackLayout("rack-1", "node-1", 4))


def read_records(path: Path, *, partial_ok: bool = False) -> list[dict]:
    """The workers' JSON lines; with ``partial_ok`` a line being written is skipped (while
    the job runs), else every line must parse."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if not partial_ok:
                raise
    return out


def start_job(cluster: DemoCluster, tmp: Path, job: str, env: dict[str, str], run_args: list[str]):
    """Write the job's spec and start one ``tpflex-run`` per rack (demo workers; each in a
    session of its own, its stderr in ``tmp/<node>.log``, its ranks' logs in
    ``tmp/<node>/``). Returns (spec, launchers). The ranks are forked from a zygote
    (``--preload``): what these tests assert does not depend on how a rank process starts
    (tests/launch/test_tpflex_run.py checks both ways), and each of 8 ranks, and every
    restart, would import torch for seconds of CPU."""
    spec = demo_job_spec(job, [(r.name, r.node, r.gpus) for r in RACKS], LOCAL_BATCH, DEMO_MODEL.unit_counts())
    write_spec(spec, tmp / "job.json")
    launchers = []
    for r in RACKS:
        launchers.append(subprocess.Popen(
            [RUN, "--controller", cluster.trainer_endpoint, "--job-spec", str(tmp / "job.json"),
             "--node", r.node, "--log-dir", str(tmp / r.node), "--preload", ",".join(worker_preload()),
             "--register-token-file", str(cluster.admin_token_file), *run_args, "--",
             sys.executable, "-m", "tpflex_trainer.demo.worker"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{r.node}.log", "wb"),
            start_new_session=True))
    return spec, launchers


def wait_rank_step(out: Path, rank: int, step: int, timeout: float = 180) -> dict:
    """The first record of ``rank`` completing a step >= ``step``."""
    return wait_until(lambda: next((r for r in read_records(out, partial_ok=True) if r["kind"] == "step"
                                    and r["rank"] == rank and r["step"] >= step), None),
                      timeout, f"rank {rank}'s step {step}")


def kill_launchers(launchers: list[subprocess.Popen]) -> None:
    """SIGKILL every launcher still running, with its session (its ranks)."""
    for p in launchers:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
