"""What every rank gets from ``tpflex-run`` (read back from the ranks' own records), how
the node is found (argument, Slurm under srun, Kubernetes downward API), GPU UUIDs from
NVML (the fake libnvidia-ml.so.1), and bad arguments: exit 2, a message naming the
argument, no traceback, no rank started."""

from __future__ import annotations

import os
import subprocess

import pytest
from tpflex_trainer.launch import cli

from tests.agent.support import FakeNvml, build_fake_nvml
from tests.launch.support import RUN, Launcher, base_env, job_spec
from tests.launch.test_cli_hostile import TEST_CA_PEM


def run_once(tmp_path, args, env=None):
    run = Launcher(tmp_path, args, env={"CHILD_MODE": "once", **(env or {})})
    try:
        status = run.wait()
    finally:
        run.close()
    return status, run


def test_every_rank_gets_its_gpu_the_job_and_the_control_plane(tmp_path):
    spec = job_spec(tmp_path / "job.json", nodes={"n0": 2, "n1": 2})
    ca = tmp_path / "ca.pem"
    ca.write_text(TEST_CA_PEM)  # checked at start: a readable PEM CA
    status, run = run_once(tmp_path, ["--controller", "10.0.0.1:8471,10.0.0.2:8471", "--job-spec",
                                      str(spec.relative_to(tmp_path)), "--node", "n1", "--tls-ca", str(ca)],
                           env={"RANK": "9", "OMP_NUM_THREADS": "3"})
    assert status == 0, run.log()
    for local in (0, 1):
        (start,) = run.events(local, "start")
        env = start["env"]
        assert env == {
            "TPFLEX_CONTROLLER": "10.0.0.1:8471,10.0.0.2:8471", "TPFLEX_JOB": "run-job",
            "TPFLEX_JOB_SPEC": str(spec), "TPFLEX_NODE": "n1", "TPFLEX_GPU": str(local),
            "TPFLEX_GPU_UUID": "", "TPFLEX_STORE": "tpflex://", "TPFLEX_LOCAL_RANK": str(local),
            "TPFLEX_RESTART_COUNT": "0", "TPFLEX_CUDA_DEVICE": str(local), "TPFLEX_TLS_CA": str(ca),
            "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": None, "RANK": None, "OMP_NUM_THREADS": "3",
            "TPFLEX_JOB_CREDENTIAL_FILE": None, "TPFLEX_REGISTER_TOKEN_FILE": None,
        }


@pytest.mark.parametrize("env, node, source", [
    ({"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, "n1", "slurm"),
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "NODE_NAME": "n1"}, "n1", "kubernetes"),
])
def test_the_node_comes_from_slurm_or_kubernetes(tmp_path, env, node, source):
    spec = job_spec(tmp_path / "job.json", nodes={"n0": 2, "n1": 2})
    status, run = run_once(tmp_path, ["--controller", "c:1", "--job-spec", str(spec), "--store", "h:1"], env)
    assert status == 0, run.log()
    assert {run.events(r, "start")[0]["env"]["TPFLEX_NODE"] for r in (0, 1)} == {node}
    assert f"node_source={source}" in run.log()


def test_an_argument_wins_over_slurm(tmp_path):
    spec = job_spec(tmp_path / "job.json", nodes={"n0": 1, "n1": 1})
    status, run = run_once(tmp_path, ["--controller", "c:1", "--job-spec", str(spec), "--node", "n0"],
                           {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"})
    assert status == 0 and run.events(0, "start")[0]["env"]["TPFLEX_NODE"] == "n0"


def test_gpu_uuids_come_from_nvml_and_isolation_uses_them(tmp_path):
    build_fake_nvml()
    nvml = FakeNvml(tmp_path / "nvml.state", count=4)
    spec = job_spec(tmp_path / "job.json", nodes={"n0": 4})
    status, run = run_once(tmp_path, ["--controller", "c:1", "--job-spec", str(spec), "--node", "n0",
                                      "--gpus", "1,3", "--isolate-gpus"], nvml.env())
    assert status == 0, run.log()
    envs = [run.events(r, "start")[0]["env"] for r in (0, 1)]
    assert [(e["TPFLEX_GPU"], e["TPFLEX_GPU_UUID"], e["CUDA_VISIBLE_DEVICES"], e["TPFLEX_CUDA_DEVICE"])
            for e in envs] == [("1", "GPU-fake-0001", "GPU-fake-0001", "0"),
                               ("3", "GPU-fake-0003", "GPU-fake-0003", "0")]


def test_an_inherited_cuda_visible_devices_is_mapped_to_cuda_indices(tmp_path):
    spec = job_spec(tmp_path / "job.json", nodes={"n0": 4})
    status, run = run_once(tmp_path, ["--controller", "c:1", "--job-spec", str(spec), "--node", "n0",
                                      "--gpus", "2-3"], {"CUDA_VISIBLE_DEVICES": "3,2"})
    assert status == 0, run.log()
    assert [run.events(r, "start")[0]["env"]["TPFLEX_CUDA_DEVICE"] for r in (0, 1)] == ["1", "0"]


def bad(args, env=None, command=("python3", "-c", "pass")):
    """tpflex-run as a real process: (exit status, stderr)."""
    proc = subprocess.run([RUN, *args, "--", *command] if command else [RUN, *args],
                          env=base_env(**(env or {})), capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr


def bad_in_process(args, env, monkeypatch, capsys, command=("python3", "-c", "pass")):
    """The same checks without a process start: main() in this process."""
    monkeypatch.setattr(os, "environ", base_env(**(env or {})))
    try:
        code = cli.main([*args, "--", *command] if command else list(args))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


def test_bad_arguments_exit_2_naming_the_argument(tmp_path, monkeypatch, capsys):
    spec = str(job_spec(tmp_path / "job.json", nodes={"n0": 4, "n1": 2}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    ok = ["--controller", "c:1", "--job-spec", spec, "--node", "n0"]
    cases = [
        (["--controller", "c:1", "--node", "n0"], None, "--job-spec: missing"),
        (["--job-spec", spec, "--node", "n0"], None, "--controller: no controller"),
        ([*ok[:3], str(tmp_path / "nope.json"), "--node", "n0"], None, "--job-spec: cannot read"),
        ([*ok[:3], str(garbage), "--node", "n0"], None, "--job-spec: "),
        ([*ok, "--job", "other"], None, "--job: 'other' but the job spec is for 'run-job'"),
        ([*ok, "--gpus", "a"], None, "argument --gpus: 'a' is not an index"),
        ([*ok, "--gpus", "3-1"], None, "argument --gpus: '3-1' is not within"),
        ([*ok, "--gpus", "5"], None, "--gpus: GPU n0:5 is not a rank of job run-job"),
        ([*ok, "--nproc-per-node", "0"], None, "argument --nproc-per-node: must be >= 1"),
        ([*ok, "--nproc-per-node", "2", "--gpus", "1"], None, "not allowed with argument"),
        ([*ok, "--grace-period-s", "-1"], None, "argument --grace-period-s: must be >= 0"),
        ([*ok, "--tls-ca", str(tmp_path / "none.pem")], None, "--tls-ca: cannot read"),
        ([*ok[:4], "--node", "n9"], None, "--gpus: job run-job's spec names no GPU of node n9"),
        ([*ok[:4], "--node", "bad name"], None, "--node: node name 'bad name'"),
        (ok[:4], {"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "n0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"},
         "--node: srun runs 4(x2) tasks per node"),
        (ok[:4], {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, "--node: in a Kubernetes pod without NODE_NAME"),
        ([*ok, "--gpus", "1"], {"CUDA_VISIBLE_DEVICES": "0"}, "--gpus: CUDA_VISIBLE_DEVICES=0 does not include GPU 1"),
        ([*ok, "--preload", "torch,not-a-module"], None, "argument --preload: not a module name: 'not-a-module'"),
        (ok, {"TPFLEX_PRELOAD": "torch,bad name"}, "--preload: not a module name: 'bad name' (TPFLEX_PRELOAD)"),
    ]
    for args, env, message in cases:
        code, err = bad_in_process(args, env, monkeypatch, capsys)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    code, err = bad_in_process(ok, None, monkeypatch, capsys, command=())
    assert code == 2 and "COMMAND: missing the training command after --" in err
    code, err = bad_in_process(ok, None, monkeypatch, capsys, command=("no-such-program-here",))
    assert code == 2 and "COMMAND: 'no-such-program-here' is not an executable" in err


def test_bad_arguments_as_a_real_process_and_gpus_nvml_does_not_have(tmp_path):
    build_fake_nvml()
    spec = str(job_spec(tmp_path / "job.json", nodes={"n0": 4}))
    ok = ["--controller", "c:1", "--job-spec", spec, "--node", "n0"]
    nvml = FakeNvml(tmp_path / "nvml.state", count=2).env()  # the library is loaded at process start
    for args, env, message in [([*ok, "--gpus", "3"], nvml, "--gpus: GPU 3 does not exist on this node (NVML sees 2)"),
                               ([*ok, "--gpus", "x"], None, "argument --gpus: 'x' is not an index")]:
        code, err = bad(args, env)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
