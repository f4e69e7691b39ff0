"""The demo's story, shortened, with TLS and tokens on (issue 7): etcd with client TLS,
client-certificate checks and user/password auth; mTLS between the controller and the
agents and on the trainer plan stream; REST over HTTPS with admin and read-only tokens.
The story's outcome must be the plain run's, and the security must really be on."""

from __future__ import annotations

import ssl

import grpc
import httpx
import pytest
from tpflex_proto import (
    agent_pb2,
    agent_pb2_grpc,
    controller_pb2,
    controller_pb2_grpc,
    keys,
    types_pb2,
)
from tpflex_proto.etcd import Etcd, EtcdTls
from tpflex_proto.tls import channel_credentials
from tpflex_trainer.demo.cluster import DemoCluster
from tpflex_trainer.demo.story import FAILED_GPU, JOB, Story, StoryConfig
from tpflex_trainer.demo.summary import summarize
from tpflex_trainer.hooks.config import HooksConfig, HooksConfigError

from tests.e2e.support import PHASE_S, etcd_history, free_base_port, reference_for, rel_diff
from tests.e2e.test_demo_story import RANK_OF_FAILED, _plan_degrees, _plan_gpus

_ENV = {"TPFLEX_CONTROLLER": "127.0.0.1:1", "TPFLEX_JOB": "j", "TPFLEX_NODE": "n", "TPFLEX_GPU": "0",
        "TPFLEX_STORE": "127.0.0.1:2", "TPFLEX_JOB_SPEC": "/dev/null"}


def _refused(method, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        method(request, timeout=3)
    return err.value.code()


def _security_checks(cluster: DemoCluster) -> None:
    c = cluster.certs
    # the trainer plan stream: a plaintext client, and a TLS client without a certificate
    register = controller_pb2.RegisterJobRequest()
    with grpc.insecure_channel(cluster.trainer_endpoint) as ch:
        stub = controller_pb2_grpc.TrainerStub(ch)
        assert _refused(stub.RegisterJob, register) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(cluster.trainer_endpoint, channel_credentials(c.ca)) as ch:
        stub = controller_pb2_grpc.TrainerStub(ch)
        assert _refused(stub.RegisterJob, register) == grpc.StatusCode.UNAVAILABLE

    # an agent: plaintext and certificate-less TLS refused, mTLS with a CA-signed one served
    agent = cluster.agent_addresses["node-0"]
    for creds in (None, channel_credentials(c.ca)):
        with (grpc.secure_channel(agent, creds) if creds else grpc.insecure_channel(agent)) as ch:
            stub = agent_pb2_grpc.AgentStub(ch)
            code = _refused(stub.GetDevices, agent_pb2.GetDevicesRequest())
            assert code == grpc.StatusCode.UNAVAILABLE
    with cluster.agent_channel("node-0") as ch:
        assert len(agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5).gpus) == 4

    # REST: HTTPS only; a mutating call needs the admin token
    ctx = ssl.create_default_context(cafile=c.ca)
    with httpx.Client(base_url=cluster.rest_url, verify=ctx, timeout=10) as http:
        drain, body = "/v1/nodes/node-0/gpus/0/drain", {"reason": "test"}
        assert http.post(drain, json=body).status_code == 401
        read_only = cluster.rest_headers(admin=False)
        assert http.post(drain, json=body, headers=read_only).status_code == 403
        assert http.get("/v1/status", headers=read_only).status_code == 200
        assert http.get("/v1/nodes/node-0/gpus/0", headers=read_only).json()["drained"] is False
    with pytest.raises(httpx.HTTPError):
        httpx.get(cluster.rest_url.replace("https://", "http://") + "/v1/status", timeout=5)

    # etcd: auth is on. Without a user etcd takes the certificate's CN as the user name (the
    # services' certificates name their users); the trainers' CN is no etcd user
    anonymous = Etcd([cluster.etcd_endpoint], timeout=3.0,
                     tls=EtcdTls(c.ca, c.cert("trainer"), c.key("trainer")))
    try:
        with pytest.raises(Exception, match="(?i)user|auth|permission"):
            anonymous.get(keys.LEADER)
    finally:
        anonymous.close()


@pytest.mark.slow
@pytest.mark.timeout(270)
def test_short_demo_story_with_tls_and_tokens(tmp_path):
    story = Story(StoryConfig(workdir=tmp_path, base_port=free_base_port(), steps=64,
                              fail_at_step=10, repair_at_step=24, phase_timeout_s=PHASE_S, tls=True))
    try:
        story.start()
        run = story.play()
        etcd = story.cluster.etcd
        plans = etcd_history(etcd, keys.job_plan(JOB), types_pb2.Plan)
        acks = etcd_history(etcd, keys.job_acks(JOB), types_pb2.Ack)
        _security_checks(story.cluster)
    finally:
        story.stop()

    # the trainers ran with TLS and a client certificate
    env = story.cluster.trainer_env()
    assert env["TPFLEX_TLS_CERT"].endswith("trainer.pem")

    # the story's outcome: generations 1, 2, 3 at 4+4, 4+3, 4+4
    assert [p.generation for p in plans] == [1, 2, 3]
    assert [_plan_degrees(p) for p in plans] == [[4, 4], [4, 3], [4, 4]]
    assert FAILED_GPU not in _plan_gpus(plans[1]) and FAILED_GPU in _plan_gpus(plans[2])
    ran = {(r["rank"], r["generation"]) for r in run.records if r["kind"] == "step"}
    assert {g for _, g in ran} == {1, 2, 3}
    acked = {(a.rank, a.generation) for a in acks}
    assert ran <= acked and (RANK_OF_FAILED, 2) not in acked

    # loss parity with the single-process reference, and no phase over its bound
    last: dict[int, dict] = {}
    for r in sorted((r for r in run.records if r["kind"] == "step"), key=lambda r: r["t"]):
        last[r["step"]] = r
    assert sorted(last) == list(range(64))
    ref = reference_for({s: r["global_batch"] for s, r in last.items()})
    assert max(rel_diff(last[s]["loss"], ref[s]) for s in last) <= 1e-5
    summary = summarize(run)
    assert summary.violations() == [], summary.phases_failure


@pytest.mark.parametrize(("extra", "message"), [
    ({"TPFLEX_TLS_CA": "/etc/hostname", "TPFLEX_TLS_CERT": "/etc/hostname"}, "go together"),
    ({"TPFLEX_TLS_CERT": "/etc/hostname", "TPFLEX_TLS_KEY": "/etc/hostname"}, "needs TPFLEX_TLS_CA"),
    ({"TPFLEX_TLS_CA": "/nonexistent/ca.pem"}, "TPFLEX_TLS_CA: cannot read"),
])
def test_trainer_tls_settings_are_checked(extra, message):
    with pytest.raises(HooksConfigError, match=message):
        HooksConfig.from_env({**_ENV, **extra})


def test_trainer_tls_settings_pass_through():
    config = HooksConfig.from_env({**_ENV, "TPFLEX_TLS_CA": "/etc/hostname", "TPFLEX_TLS_CERT": "/etc/hostname",
                                   "TPFLEX_TLS_KEY": "/etc/hostname", "TPFLEX_TLS_SERVER_NAME": "ctl"})
    assert (config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name) == (
        "/etc/hostname", "/etc/hostname", "/etc/hostname", "ctl")
