"""tpflex-run and the job's credential, against a real controller trainer server (job
credentials required) and a real etcd: with an admin token it registers the job before
any rank starts and hands the ranks the credential's file (never the token), which it
deletes when it ends; a refused registration or unusable flags end it with exit 2 and a
message, no rank started."""

from __future__ import annotations

import pytest
from tpflex_controller import synthetic
from tpflex_controller.credentials import Credentials, JobAuth
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, keys, types_pb2

from tests.launch.support import Launcher, job_spec
from tests.support.etcd_server import EtcdCluster

ADMIN = "launch-admin-token"


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    from tpflex_proto.etcd import Etcd

    cluster = EtcdCluster(1, tmp_path_factory.mktemp("etcd") / "etcd")
    cluster.start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    synthetic.store_cluster(etcd, [synthetic.rack("r0", 1, 2)])
    auth = JobAuth(Credentials(etcd), admin_check=lambda token, job: "ops" if token == ADMIN else None)
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=16, job_auth=auth)
    server.start()
    try:
        yield etcd, f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait()
        etcd.close()
        cluster.stop()


def _run(tmp_path, endpoint, *extra: str, env=None) -> tuple[int, Launcher]:
    spec = job_spec(tmp_path / "job.json", nodes={"r0-n00": 2})
    run = Launcher(tmp_path, ["--controller", endpoint, "--job-spec", str(spec), "--node", "r0-n00",
                              *extra], env={"CHILD_MODE": "once", **(env or {})})
    try:
        return run.wait(60), run
    finally:
        run.close()


def _token_file(tmp_path, text: str):
    path = tmp_path / "register.token"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_tpflex_run_registers_the_job_and_hands_its_ranks_the_credential(tmp_path, controller):
    etcd, endpoint = controller
    token = _token_file(tmp_path, f"# the launcher's token\n{ADMIN}\n")
    status, run = _run(tmp_path, endpoint, "--register-token-file", str(token))
    assert status == 0, run.log()
    stored = codec.decode(types_pb2.JobCredential, etcd.get(keys.job_credential("run-job", "node-r0-n00")).value)
    assert stored.issued_by == "operator:ops"
    files = {run.events(r, "start")[0]["env"]["TPFLEX_JOB_CREDENTIAL_FILE"] for r in (0, 1)}
    assert len(files) == 1 and None not in files
    assert {run.events(r, "start")[0]["env"]["TPFLEX_REGISTER_TOKEN_FILE"] for r in (0, 1)} == {None}
    (path,) = files
    assert not (tmp_path / path).exists(), "the credential file outlived tpflex-run"
    assert ADMIN not in run.log()


@pytest.mark.parametrize("token, why", [
    ("someone-else\n", "UNAUTHENTICATED"),
    ("two tokens\n", "exactly one token"),
    ("a\nb\n", "exactly one token"),
])
def test_a_refused_or_unusable_register_token_ends_tpflex_run_before_any_rank(tmp_path, controller, token, why):
    _, endpoint = controller
    status, run = _run(tmp_path, endpoint, "--register-token-file", str(_token_file(tmp_path, token)))
    assert status == 2, run.log()
    assert why in run.log() and "Traceback" not in run.log()
    assert run.records(0) == [] and run.records(1) == []


def test_a_credential_file_is_passed_on_and_the_two_ways_exclude_each_other(tmp_path, controller):
    etcd, endpoint = controller
    credential = tmp_path / "job.credential"
    credential.write_text("tpjc:run-job:ops:" + "s" * 43 + "\n")
    status, run = _run(tmp_path, endpoint, "--job-credential-file", str(credential))
    assert status == 0, run.log()
    assert {run.events(r, "start")[0]["env"]["TPFLEX_JOB_CREDENTIAL_FILE"] for r in (0, 1)} == {str(credential)}
    assert credential.exists()  # the operator's file is left alone
    (tmp_path / "both").mkdir()
    status, run = _run(tmp_path / "both", endpoint, "--job-credential-file", str(credential),
                       "--register-token-file", str(_token_file(tmp_path, ADMIN)))
    assert status == 2 and "not both" in run.log(), run.log()
    blank = tmp_path / "blank.credential"
    blank.write_text("\n")
    (tmp_path / "blank").mkdir()
    status, run = _run(tmp_path / "blank", endpoint, "--job-credential-file", str(blank))
    assert status == 2 and "not a job credential" in run.log(), run.log()


def test_a_controller_that_checks_no_credentials_issues_none_and_the_ranks_start(tmp_path, served):
    """[trainer] job_credentials = off: registering with the token still works; the ranks
    get no credential file and tpflex-run says why."""
    synthetic.store_cluster(served.etcd, [synthetic.rack("r0", 1, 2)])
    token = _token_file(tmp_path, ADMIN)
    status, run = _run(tmp_path, served.endpoint, "--register-token-file", str(token))
    assert status == 0, run.log()
    assert {run.events(r, "start")[0]["env"]["TPFLEX_JOB_CREDENTIAL_FILE"] for r in (0, 1)} == {None}
    assert "issued no credential" in run.log()
