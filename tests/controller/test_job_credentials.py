"""Per-job trainer credentials on the real Trainer + Rendezvous gRPC server and a real
etcd: an operator's admin token registers a job and is issued its credential; with job
A's credential every call on job B is refused (PERMISSION_DENIED) and nothing is written;
without a credential, with a forged, rotated or revoked one, refused (UNAUTHENTICATED);
every refusal is an audit line."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from tpflex_controller import synthetic
from tpflex_controller.credentials import Credentials, JobAuth, parse_token
from tpflex_controller.store import Store
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2

from tests.controller import api_harness as h
from tests.controller.controller_harness import small_cluster
from tests.security.trainer_calls import bearer, every_call, status_of

ADMIN = "admin-secret-token"
LIMITED = "limited-secret-token"  # an admin token limited to job-a


def _admin(token: str, job: str) -> str | None:
    if token == ADMIN:
        return "ops"
    return "limited" if token == LIMITED and job == "job-a" else None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def plane(etcd):
    clock = Clock()
    auth = JobAuth(Credentials(etcd, ttl_s=1.0, clock=clock), admin_check=_admin)
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=16, job_auth=auth)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, auth, clock
    finally:
        channel.close()
        server.stop(grace=1).wait()


def _register(channel, spec, token: str, name: str = "") -> controller_pb2.RegisterJobResponse:
    stub = controller_pb2_grpc.TrainerStub(channel)
    return stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec, credential_name=name),
                            timeout=5, metadata=bearer(token))


def _jobs(etcd):
    racks = small_cluster(etcd)
    a = synthetic.job("job-a", [racks[0].name], racks[0].domain_size)
    b = synthetic.job("job-b", [racks[1].name], racks[1].domain_size)
    return racks, a, b


def _revision(etcd) -> int:
    return etcd.get_prefix("/", keys_only=True)[1]


def _audit(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tpflex.audit"]


def test_an_admin_token_registers_a_job_and_is_issued_its_credential(etcd, plane, caplog):
    channel, _, _ = plane
    racks, a, _ = _jobs(etcd)
    caplog.set_level(logging.INFO, logger="tpflex.audit")
    got = _register(channel, a, ADMIN, "node-1")
    (issued,) = _audit(caplog)
    assert (issued["who"], issued["what"], issued["target"], issued["outcome"], issued["credential"]) == \
        ("operator:ops", "trainer.RegisterJob", "job:job-a", "ok", "node-1")
    assert issued["request_id"] and got.credential not in json.dumps(issued)
    assert got.credential_name == "node-1" and parse_token(got.credential) == ("job-a", "node-1")
    assert etcd.get(keys.job_spec("job-a")) is not None
    stored = codec.decode(types_pb2.JobCredential, etcd.get(keys.job_credential("job-a", "node-1")).value)
    assert stored.issued_by == "operator:ops" and len(stored.sha256) == 32
    secret = got.credential.rsplit(":", 1)[1].encode()
    everything, _ = etcd.get_prefix("/")
    assert not any(secret in kv.value for kv in everything), "the secret itself is stored"
    # a second registrant (another node) gets a credential of its own; the first still works
    other = _register(channel, a, ADMIN, "node-2")
    assert other.credential != got.credential
    for token in (got.credential, other.credential):
        code, details = status_of(every_call(channel, a, "rack0-n00", 0, bearer(token))["rendezvous.NumKeys"])
        assert code == grpc.StatusCode.OK, details
    # a limited admin token registers its job only; read-only, unknown, none: refused
    assert _register(channel, a, LIMITED, "node-3").credential
    b = synthetic.job("job-b", [racks[1].name], racks[1].domain_size)
    for token in (LIMITED, "not-a-token", ""):
        code, _ = status_of(lambda t=token: _register(channel, b, t, "x"))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert etcd.get(keys.job_spec("job-b")) is None


def test_job_a_credential_is_refused_on_every_call_of_job_b_and_nothing_is_written(etcd, plane, caplog):
    channel, auth, _ = plane
    _, a, b = _jobs(etcd)
    cred_a = _register(channel, a, ADMIN, "node-a").credential
    _register(channel, b, ADMIN, "node-b")
    caplog.set_level(logging.INFO, logger="tpflex.audit")
    before = _revision(etcd)
    calls = every_call(channel, b, "rack1-n00", 0, bearer(cred_a))
    assert len(calls) == 16  # 6 Trainer + 10 Rendezvous methods
    for name, call in calls.items():
        code, details = status_of(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (name, code, details)
        assert "job 'job-a''s, not job 'job-b''s" in details, (name, details)
    assert _revision(etcd) == before, "a refused call wrote to etcd"
    assert auth.refused == 16
    lines = _audit(caplog)
    assert sorted(e["what"] for e in lines) == sorted(calls)
    assert {(e["who"], e["target"], e["outcome"]) for e in lines} == {("job:job-a/node-a", "job:job-b", "denied")}
    assert all(e["request_id"] for e in lines)

    # the positive control: the same calls on job A with A's credential pass the check
    etcd.put(keys.job_plan("job-a"), codec.encode(types_pb2.Plan(job="job-a", generation=1)))
    for name, call in every_call(channel, a, "rack0-n00", 0, bearer(cred_a)).items():
        code, details = status_of(call)
        assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), (name, details)
    assert _revision(etcd) > before  # they did write (an ack, the store's keys, a restart)


def test_no_forged_rotated_or_revoked_credential_is_accepted(etcd, plane):
    channel, _, clock = plane
    _, a, b = _jobs(etcd)
    first = _register(channel, b, ADMIN, "node-b").credential
    job, name = parse_token(first)
    forged = f"tpjc:{job}:{name}:{'x' * 43}"
    for label, metadata in (("none", ()), ("not a credential", bearer("hello")), ("forged", bearer(forged))):
        before = _revision(etcd)
        for call_name, call in every_call(channel, b, "rack1-n00", 0, metadata).items():
            code, details = status_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (label, call_name, code, details)
        assert _revision(etcd) == before

    def numkeys(token: str) -> grpc.StatusCode:
        return status_of(every_call(channel, b, "rack1-n00", 0, bearer(token))["rendezvous.NumKeys"])[0]

    assert numkeys(first) == grpc.StatusCode.OK
    rotated = _register(channel, b, ADMIN, "node-b").credential  # the same name: replaces it
    assert numkeys(rotated) == grpc.StatusCode.OK
    assert numkeys(first) == grpc.StatusCode.UNAUTHENTICATED

    # the job deleted (as DELETE /v1/jobs/job-b does): its credentials go with it
    store = Store(etcd)
    spec_kv = etcd.get(keys.job_spec("job-b"))
    assert store.write_spec("job-b", None, spec_revision=spec_kv.mod_revision,
                            guard_revision=store.spec_guard_revision())
    assert etcd.get_prefix(keys.job_credentials("job-b"))[0] == []
    clock.now += 1.0  # this replica's cache of a positive answer lasts ttl_s
    assert numkeys(rotated) == grpc.StatusCode.UNAUTHENTICATED
    # registered again under the same name: the old credential stays dead
    _register(channel, b, ADMIN, "other")
    assert numkeys(rotated) == grpc.StatusCode.UNAUTHENTICATED


def test_a_heartbeat_stream_cannot_switch_to_another_job(etcd, plane):
    channel, _, _ = plane
    _, a, b = _jobs(etcd)
    cred_a = _register(channel, a, ADMIN, "node-a").credential
    _register(channel, b, ADMIN, "node-b")
    stub = controller_pb2_grpc.TrainerStub(channel)
    beats = iter([controller_pb2.Beat(job="job-a", rank=0), controller_pb2.Beat(job="job-b", rank=0)])
    before = etcd.get(keys.liveness("job-b"))
    code, details = status_of(lambda: stub.Heartbeat(beats, timeout=5, metadata=bearer(cred_a)))
    assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT), details
    assert etcd.get(keys.liveness("job-b")) == before


def test_operators_list_issue_and_revoke_credentials_over_rest(etcd, plane, tmp_path):
    """The REST routes over real HTTP (uvicorn) on the same etcd: a limited token only on
    its job; the secret once, never in a listing; a revoked one refused by the trainer
    plane once its 1 s cache of the positive check lapses."""
    channel, _, clock = plane
    _, a, b = _jobs(etcd)
    _register(channel, a, ADMIN, "node-a")
    _register(channel, b, ADMIN, "node-b")
    (tmp_path / "admin.tokens").write_text(f"ops {ADMIN}\nlauncher-a {LIMITED} jobs=job-a\n")
    (tmp_path / "readonly.tokens").write_text("")
    served = h.serve(etcd, tmp_path)
    http = served.http
    try:
        ops, limited = ({"Authorization": f"Bearer {t}"} for t in (ADMIN, LIMITED))
        r = http.post("/v1/jobs/job-a/credentials", json={"name": "spare"}, headers=limited)
        assert r.status_code == 201, r.text
        issued = r.json()
        assert issued["issued_by"] == "operator:launcher-a" and parse_token(issued["credential"]) == ("job-a", "spare")
        assert http.post("/v1/jobs/job-b/credentials", json={"name": "x"}, headers=limited).status_code == 403
        assert http.post("/v1/jobs/job-a/credentials", json={"name": "bad name"}, headers=ops).status_code == 422
        assert http.post("/v1/jobs/nope/credentials", json={"name": "x"}, headers=ops).status_code == 404
        listed = http.get("/v1/jobs/job-a/credentials", headers=ops).json()
        assert [c["name"] for c in listed] == ["node-a", "spare"]
        assert issued["credential"] not in str(listed)

        numkeys = every_call(channel, a, "rack0-n00", 0, bearer(issued["credential"]))["rendezvous.NumKeys"]
        assert status_of(numkeys)[0] == grpc.StatusCode.OK
        r = http.delete("/v1/jobs/job-a/credentials/spare", headers=limited)
        assert r.status_code == 200 and r.json()["revoked"], r.text
        assert http.delete("/v1/jobs/job-a/credentials/spare", headers=ops).status_code == 404
        assert [c["name"] for c in http.get("/v1/jobs/job-a/credentials", headers=ops).json()] == ["node-a"]
        assert status_of(numkeys)[0] == grpc.StatusCode.OK  # the trainer plane's 1 s cache...
        clock.now += 1.0
        assert status_of(numkeys)[0] == grpc.StatusCode.UNAUTHENTICATED  # ...then refused
    finally:
        served.close()


def test_tpflexctl_issues_lists_and_revokes_credentials(etcd, plane, tmp_path):
    """tpflexctl against the served API: the secret goes to a 0600 file (never printed
    with --out), the listing names it, revoking it removes it; bad input exits 2."""
    import subprocess
    import sys

    channel, _, _ = plane
    _, a, _ = _jobs(etcd)
    _register(channel, a, ADMIN, "node-a")
    (tmp_path / "admin.tokens").write_text(f"ops {ADMIN}\n")
    (tmp_path / "readonly.tokens").write_text("")
    token_file = tmp_path / "ops.token"
    token_file.write_text(ADMIN + "\n")
    served = h.serve(etcd, tmp_path)

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tpflex_cli", "--url", served.url,
                               "--token-file", str(token_file), *args], capture_output=True, text=True,
                              timeout=60)
    try:
        out = tmp_path / "spare.credential"
        issued = ctl("issue-credential", "job-a", "spare", "--out", str(out))
        assert issued.returncode == 0, issued.stderr
        secret = out.read_text().strip()
        assert parse_token(secret) == ("job-a", "spare") and oct(out.stat().st_mode & 0o777) == "0o600"
        assert secret not in issued.stdout + issued.stderr and str(out) in issued.stdout
        again = ctl("issue-credential", "job-a", "spare", "--out", str(out))  # never over a file
        assert again.returncode == 2 and "cannot create" in again.stderr and out.read_text().strip() == secret
        listed = ctl("credentials", "job-a")
        assert listed.returncode == 0 and "spare" in listed.stdout and "operator:ops" in listed.stdout
        assert secret not in listed.stdout
        revoked = ctl("revoke-credential", "job-a", "spare")
        assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
        assert "spare" not in ctl("credentials", "job-a").stdout
        missing = ctl("revoke-credential", "job-a", "spare")
        assert missing.returncode != 0 and "Traceback" not in missing.stderr
    finally:
        served.close()
