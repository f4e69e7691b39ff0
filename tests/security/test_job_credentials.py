"""Per-job trainer identity against the real services: a secured stack (etcd with TLS and
auth, a ``tpflex-controller`` with its REST child, a ``tpflex-agent``), job A trained by
``tpflex-run`` (which registers the job with an admin token and hands its ranks the
credential it is issued) and job B registered beside it. With job A's credential every
trainer-plane call on job B is refused with PERMISSION_DENIED and none of B's keys
changes; without a credential, refused; job B deleted, its credential is dead; job A
trains throughout, with no restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import grpc
from tpflex_controller import synthetic
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2
from tpflex_proto.tls import channel_credentials
from tpflex_trainer.demo.launcher import demo_job_spec, worker_preload
from tpflex_trainer.demo.model import DEMO_MODEL
from tpflex_trainer.hooks.config import write_spec

from tests.launch.demo_job import read_records
from tests.launch.support import RUN, base_env
from tests.security.stack import ADMIN_TOKEN, PASSWORDS
from tests.security.trainer_calls import bearer, every_call, status_of
from tests.support.wait import wait_until

GPUS = 2
AUDIT = re.compile(r" tpflex\.audit (\{.*\})$", re.M)


def _job_keys(etcd, job: str) -> dict[str, int]:
    """Every key of ``job`` (spec, plan, acks, liveness, rendezvous store, credentials) with
    its mod revision."""
    out = {}
    for prefix in (keys.job_prefix(job), keys.rendezvous_prefix(job), keys.liveness(job),
                   keys.job_credentials(job), keys.job_override(job)):
        out.update({kv.key: kv.mod_revision for kv in etcd.get_prefix(prefix, keys_only=True)[0]})
    return out


def _steps(out) -> dict[int, int]:
    done: dict[int, int] = {}
    for r in read_records(out, partial_ok=True):
        if r["kind"] == "step":
            done[r["rank"]] = max(done.get(r["rank"], -1), r["step"])
    return done


def test_a_job_credential_acts_on_its_own_job_only(stack, tmp_path):
    etcd = stack.etcd.client(cert="controller", user="tpflex-controller", password=PASSWORDS["tpflex-controller"])
    devices_rack = types_pb2.Rack(name="rack-sec", domain_size=GPUS, power_budget_w=GPUS * 700.0,
                                  gpu_tdp_w=700.0, gpu_min_w=200.0, gpu_max_w=900.0,
                                  nodes=[stack.agent_node], gpus_per_node=GPUS)
    etcd.put(keys.rack("rack-sec"), codec.encode(devices_rack))
    synthetic.store_cluster(etcd, [synthetic.rack("rack-b", 1, 2)])
    spec_a = demo_job_spec("job-a", [("rack-sec", stack.agent_node, GPUS)], 4, DEMO_MODEL.unit_counts())
    spec_b = synthetic.job("job-b", ["rack-b"], 2)
    write_spec(spec_a, tmp_path / "job-a.json")
    token_file = tmp_path / "register.token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    token_file.chmod(0o600)

    endpoint = f"localhost:{stack.trainer_port}"
    channel = grpc.secure_channel(endpoint, channel_credentials(str(stack.certs / "ca.pem")))
    trainer = controller_pb2_grpc.TrainerStub(channel)

    def register(spec, name: str) -> str:
        return trainer.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec, credential_name=name),
                                   timeout=10, metadata=bearer(ADMIN_TOKEN)).credential

    out = tmp_path / "steps.jsonl"
    env = base_env(TPFLEX_DEMO_OUT=str(out), TPFLEX_DEMO_STEPS="400", TPFLEX_DEMO_STEP_MIN_S="0.1",
                   GLOO_SOCKET_IFNAME="lo", TPFLEX_LOG_LEVEL="WARNING", TPFLEX_PLAN_WAIT_S="60")
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 (closed below)
    run = subprocess.Popen(
        [RUN, "--controller", endpoint, "--job-spec", str(tmp_path / "job-a.json"),
         "--node", stack.agent_node, "--nproc-per-node", str(GPUS), "--tls-ca", str(stack.certs / "ca.pem"),
         "--register-token-file", str(token_file), "--log-dir", str(tmp_path / "ranks"),
         "--preload", ",".join(worker_preload()), "--", sys.executable, "-m", "tpflex_trainer.demo.worker"],
        env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def run_log() -> str:
        ranks = "".join(p.read_text()[-1500:] for p in (tmp_path / "ranks").glob("*.log"))
        return (tmp_path / "run.log").read_text()[-3000:] + ranks

    def trained(step: int) -> bool:
        assert run.poll() is None, f"tpflex-run exited {run.returncode}: {run_log()}"
        done = _steps(out)
        return len(done) == GPUS and min(done.values()) >= step

    try:
        wait_until(lambda: trained(2), 180, "job A's ranks training", interval=0.2,
                   fail=lambda: AssertionError(f"job A did not train: {run_log()}"))
        assert etcd.get(keys.job_credential("job-a", f"node-{stack.agent_node}")) is not None
        cred_a = register(spec_a, "probe")  # another credential of job A (same powers)
        cred_b = register(spec_b, "node-b")
        at = max(_steps(out).values())

        # ---- with job A's credential, every call on job B: PERMISSION_DENIED, nothing written
        b_before = _job_keys(etcd, "job-b")
        assert keys.job_spec("job-b") in b_before
        calls = every_call(channel, spec_b, "rack-b-n00", 0, bearer(cred_a))
        for name, call in calls.items():
            code, details = status_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (name, code, details)
        # ---- without a credential: refused too
        for name, call in every_call(channel, spec_b, "rack-b-n00", 0).items():
            code, details = status_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
        assert _job_keys(etcd, "job-b") == b_before, "a refused call changed job B's keys"

        # every refusal is an audit line of the controller's (who, what, target, outcome)
        def audited():
            lines = [json.loads(m.group(1)) for m in AUDIT.finditer(stack.controller.output())]
            return [e for e in lines if e["target"] == "job:job-b" and e["outcome"] == "denied"]
        lines = wait_until(lambda: len(audited()) >= 2 * len(calls) and audited(), 10, "the audit lines")
        assert {e["what"] for e in lines if e["who"] == "job:job-a/probe"} == set(calls)
        assert {e["what"] for e in lines if e["who"] == "anonymous"} == set(calls)

        # ---- job B deleted by an operator: its credential is dead (within the 1 s cache)
        assert status_of(every_call(channel, spec_b, "rack-b-n00", 0, bearer(cred_b))["rendezvous.NumKeys"])[0] \
            == grpc.StatusCode.OK
        with stack.http() as http:
            r = http.delete("/v1/jobs/job-b", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert r.status_code == 202, r.text
        numkeys_b = every_call(channel, spec_b, "rack-b-n00", 0, bearer(cred_b))["rendezvous.NumKeys"]
        wait_until(lambda: status_of(numkeys_b)[0] == grpc.StatusCode.UNAUTHENTICATED, 5,
                   "job B's credential refused once B is deleted")
        assert etcd.get_prefix(keys.job_credentials("job-b"))[0] == []

        # ---- job A trained on throughout: more steps, no restart epoch, no soft failure
        wait_until(lambda: trained(at + 3), 120, f"job A past step {at + 3}", interval=0.2)
        liveness = etcd.get(keys.liveness("job-a"))
        assert liveness is None or codec.decode(types_pb2.Liveness, liveness.value).restart.epoch == 0, \
            codec.decode(types_pb2.Liveness, liveness.value)
        assert "refused" not in (tmp_path / "run.log").read_text()
    finally:
        channel.close()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        log.close()
        etcd.close()
