"""deploy/slurm/: the sbatch example run with stand-in ``srun``/``scontrol`` (as Slurm
would run it on the first node), then the exact tpflex-run command it hands to srun run
once per node under Slurm's environment: one launcher per node, which finds its node from
SLURMD_NODENAME and starts the ranks the generated job spec gives that node."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from tpflex_trainer.hooks.config import load_spec
from tpflex_trainer.launch import cli

from tests.deploy.tools import DEPLOY, REPO
from tests.launch.support import CHILD, base_env

SBATCH = DEPLOY / "slurm" / "tpflex-train.sbatch"
NODES = ["gpu-a", "gpu-b"]


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _directives() -> dict[str, str]:
    out = {}
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            out[key] = value
    return out


def test_the_batch_script_is_valid_bash_with_one_task_per_node():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    d = _directives()
    assert d["ntasks-per-node"] == "1" and "nodes" in d and d["signal"].startswith("TERM@")
    # a failed node must not end the job (Slurm's default): tpflex re-plans around it
    assert "no-kill" in d and d["no-kill"] == ""


def test_checkpoints_default_to_a_directory_a_resubmitted_job_finds():
    """The default checkpoint directory is named after the job, not its id (a new id per
    submission would start every resubmitted job from scratch), and is on the submit
    directory's file system (shared by the nodes), not a node's local disk."""
    default = re.search(r"^CHECKPOINT_DIR=\$\{CHECKPOINT_DIR:-(.+)\}$", SBATCH.read_text(), re.M).group(1)
    assert default.startswith("$SLURM_SUBMIT_DIR/") and "$SLURM_JOB_NAME" in default
    assert "SLURM_JOB_ID" not in default


def test_the_sbatch_example_starts_one_tpflex_run_per_node(tmp_path, dev_certs):
    bin_dir, venv, tls = tmp_path / "bin", tmp_path / "venv" / "bin", tmp_path / "tls"
    for d in (bin_dir, venv, tls):
        d.mkdir(parents=True)
    argv_file = tmp_path / "srun.argv"
    _exe(bin_dir / "scontrol", "#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    _exe(bin_dir / "srun", f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done > {argv_file}\n"
                           f"env -0 > {tmp_path / 'srun.env'}\n")
    _exe(venv / "python", f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this venv's interpreter
    (venv / "tpflex-run").symlink_to(Path(sys.executable).parent / "tpflex-run")
    for name in ("ca.pem", "trainer.pem", "trainer-key.pem"):  # tpflex-run checks them at start
        (tls / name).write_bytes((dev_certs / name).read_bytes())
    credential = tmp_path / "job.credential"  # issued already (the other way: a register token)
    credential.write_text("tpjc:tpflex-train-4242:ops:" + "s" * 43 + "\n")
    env = base_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NAME="tpflex-train",
        SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_SUBMIT_DIR=str(REPO), SLURM_GPUS_PER_NODE="h100:4",
        TPFLEX_VENV=str(venv.parent), TLS_DIR=str(tls), JOB_DIR=str(tmp_path / "job"),
        CHECKPOINT_DIR=str(tmp_path / "checkpoints" / "tpflex-train"),
        TPFLEX_CONTROLLER="127.0.0.1:1", TRAIN_SCRIPT=CHILD[1], UNITS="heads=8,ffn=8", LOCAL_BATCH="4",
        TPFLEX_JOB_CREDENTIAL_FILE=str(credential))
    batch = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert batch.returncode == 0, batch.stderr

    spec = load_spec(str(tmp_path / "job" / "job.json"))
    assert spec.name == "tpflex-train-4242" and spec.base_tp == 4
    assert [(st.rack, [(g.node, g.index) for g in st.ranks]) for r in spec.replicas for st in r.stages] == \
        [(n, [(n, i) for i in range(4)]) for n in NODES]

    argv = argv_file.read_bytes().split(b"\0")[:-1]
    argv = [a.decode() for a in argv]
    assert "--ntasks-per-node=1" in argv and "--kill-on-bad-exit=0" in argv and "--no-kill" in argv
    # checkpoints on, for every rank (the variables the trainer hooks' settings read), in a
    # directory the script made
    srun_env = dict(x.split("=", 1) for x in (tmp_path / "srun.env").read_text().split("\0") if "=" in x)
    assert srun_env["TPFLEX_CHECKPOINT_DIR"] == str(tmp_path / "checkpoints" / "tpflex-train")
    assert int(srun_env["TPFLEX_CHECKPOINT_EVERY"]) > 0
    assert (tmp_path / "checkpoints" / "tpflex-train").is_dir()
    launcher = next(i for i, a in enumerate(argv) if a.endswith("/tpflex-run"))
    own, command = cli._split(argv[launcher + 1:])
    cli._parser().parse_args(own)  # arguments tpflex-run accepts
    records = tmp_path / "records"
    records.mkdir()
    for node in NODES:  # what srun does on each node of the allocation
        step = subprocess.run(argv[launcher:], env={
            **env, "SLURMD_NODENAME": node, "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "RECORDS_DIR": str(records), "CHILD_MODE": "once", "TPFLEX_STORE": "127.0.0.1:2"},
            capture_output=True, text=True, timeout=60)
        assert step.returncode == 0, step.stderr
        assert f"node={node} node_source=slurm" in step.stderr
        starts = [json.loads(line) for r in range(4) for line in (records / f"rank-{r}.jsonl").read_text().splitlines()]
        assert sorted((s["env"]["TPFLEX_NODE"], s["env"]["TPFLEX_GPU"]) for s in starts if s["env"]["TPFLEX_NODE"] == node) \
            == [(node, str(i)) for i in range(4)]
        assert {s["env"]["TPFLEX_TLS_CA"] for s in starts} == {str(tls / "ca.pem")}
        assert {s["env"]["TPFLEX_JOB_CREDENTIAL_FILE"] for s in starts} == {str(credential)}
    logs = sorted(p.name for p in (tmp_path / "job" / "logs").iterdir())
    assert logs == sorted(f"{n}-rank-{r}.log" for n in NODES for r in range(4))  # no clash on a shared dir


def test_make_job_spec_refuses_bad_input_with_exit_2(tmp_path):
    script = DEPLOY / "slurm" / "make-job-spec.py"
    for args, message in [
        (["--name", "j", "--nodes", "a b c", "--nodes-per-domain", "2", "--units", "heads=8"], "do not split"),
        (["--name", "j", "--nodes", "a", "--units", "heads"], "NAME=COUNT"),
        (["--name", "j", "--nodes", " ", "--units", "heads=8"], "no node names"),
    ]:
        p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
