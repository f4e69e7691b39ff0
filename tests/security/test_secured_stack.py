"""The real controller and agent processes with TLS everywhere: etcd over TLS with
user/password auth, the REST API over HTTPS with admin and read-only tokens, mTLS from the
controller to the agent (untrusted client certificates refused and logged with the peer),
and the trainer plan stream over TLS."""

from __future__ import annotations

import re
import ssl
import threading

import grpc
import httpx
import pytest
from tpflex_controller import synthetic
from tpflex_controller.agent_client import AgentPusher, PushResult
from tpflex_controller.credentials import Credentials
from tpflex_proto import (
    agent_pb2,
    agent_pb2_grpc,
    codec,
    controller_pb2,
    controller_pb2_grpc,
    keys,
    types_pb2,
)
from tpflex_proto.tls import channel_credentials
from tpflex_trainer.hooks.control import ControlClient, ControlConfig

from tests.security.stack import ADMIN_TOKEN, PASSWORDS, READ_TOKEN, wait_until

REFUSED = re.compile(r"tls client refused service=agent peer=127\.0\.0\.1:(\d+) reason=(.+)")


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _agent_stub(stack, certs, name: str | None) -> tuple[grpc.Channel, agent_pb2_grpc.AgentStub]:
    cert = (str(certs / f"{name}.pem"), str(certs / f"{name}-key.pem")) if name else (None, None)
    creds = channel_credentials(str(stack.certs / "ca.pem"), *cert)
    ch = grpc.secure_channel(stack.agent_grpc, creds)
    return ch, agent_pb2_grpc.AgentStub(ch)


def _refusals(stack) -> list[tuple[str, str]]:
    return [m.groups() for m in REFUSED.finditer(stack.agent.output())]


def test_agent_registers_through_etcd_tls_auth_and_rest_serves_it_over_https(stack):
    with stack.http() as http:
        def registered():
            r = http.get("/v1/nodes")  # 503 until the API's etcd cache has synced
            return r.status_code == 200 and r.json()

        nodes = wait_until(registered, 10, "the agent's registration")
        assert [(n["name"], n["live"], n["gpus"]["total"]) for n in nodes] == [("sec-node-1", True, 2)]
        assert nodes[0]["agent_address"] == stack.agent_grpc
        # the controller won the election via etcd (once the API's cache has the leader key)
        wait_until(lambda: http.get("/readyz").status_code == 200, 10, "readyz 200")
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
        httpx.get(f"http://127.0.0.1:{stack.rest_port}/healthz", timeout=5)
    untrusting = ssl.create_default_context()  # the system CAs do not include ours
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{stack.rest_url}/healthz", verify=untrusting, timeout=5)


def test_token_scopes_on_a_mutating_endpoint(stack):
    drain = f"/v1/nodes/{stack.agent_node}/gpus/1/drain"
    body = {"reason": "security test"}
    with stack.http() as http:
        wait_until(lambda: http.get("/v1/nodes").json(), 10, "the agent's registration")
        r = http.post(drain, json=body)
        assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"]
        assert http.post(drain, json=body, headers=_bearer("wrong-token")).status_code == 401
        r = http.post(drain, json=body, headers=_bearer(READ_TOKEN))
        assert r.status_code == 403 and "read-only" in r.json()["error"]["message"]
        assert http.get(f"/v1/nodes/{stack.agent_node}/gpus/1").json()["drained"] is False
        r = http.post(drain, json=body, headers=_bearer(ADMIN_TOKEN))
        assert r.status_code == 202, r.text
        assert http.get(f"/v1/nodes/{stack.agent_node}/gpus/1").json()["drained"] is True
        undrain = f"/v1/nodes/{stack.agent_node}/gpus/1/undrain"
        assert http.post(undrain, headers=_bearer(READ_TOKEN)).status_code == 403
        assert http.post(undrain, headers=_bearer(ADMIN_TOKEN)).status_code == 202


def test_controller_agent_client_pushes_power_plans_over_mtls(stack):
    results: list[PushResult] = []
    done = threading.Event()

    def on_result(r: PushResult) -> None:
        results.append(r)
        done.set()

    creds = channel_credentials(str(stack.certs / "ca.pem"), str(stack.certs / "controller.pem"),
                                str(stack.certs / "controller-key.pem"))
    agent, address = stack.start_agent(stack.base, "sec-node-2")  # its own power generations
    desired = types_pb2.NodePowerPlan(node="sec-node-2", generation=7)
    etcd = stack.etcd.client(user="tpflex-controller", password=PASSWORDS["tpflex-controller"])
    etcd.put(keys.power("sec-node-2"), codec.encode(desired))  # what the controller commits first
    etcd.close()
    pusher = AgentPusher(on_result, timeout=5.0, credentials=creds)
    try:
        pusher.push("sec-node-2", address, desired)
        assert done.wait(20), "no push result"
    finally:
        pusher.close()
        agent.stop()
    # the agent may have applied etcd's desired caps from its watch before the push landed
    assert results[0].ok and results[0].outcome in ("APPLIED", "ALREADY_APPLIED"), results[0]
    assert re.search(r"power plan applied node=sec-node-2 generation=7 outcome=APPLIED source=(grpc|etcd-)",
                     agent.output())


@pytest.mark.parametrize("who,reason", [
    ("rogue-controller", "CERTIFICATE_VERIFY_FAILED"),  # signed by another CA
    (None, "CERTIFICATE_REQUIRED|PEER_DID_NOT_RETURN_A_CERTIFICATE"),  # no client certificate
    ("trainer", "not an allowed client"),  # our CA, but not the controller's CN
])
def test_untrusted_clients_are_refused_by_the_agent_and_logged(stack, rogue_certs, who, reason):
    """gRPC's own mTLS: a client without a certificate of the CA fails the handshake
    (UNAVAILABLE; gRPC's own log says why, without the peer); a certificate of the CA
    with a name the agent does not allow is refused per call (PERMISSION_DENIED) and
    logged with the peer's address."""
    certs = rogue_certs if who and who.startswith("rogue") else stack.certs
    name = who.removeprefix("rogue-") if who else None
    in_handshake = who != "trainer"
    before, output_before = len(_refusals(stack)), len(stack.agent.output())
    ch, stub = _agent_stub(stack, certs, name)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
        want = grpc.StatusCode.UNAVAILABLE if in_handshake else grpc.StatusCode.PERMISSION_DENIED
        assert exc.value.code() == want, exc.value
    finally:
        ch.close()
    if in_handshake:
        handshake = re.compile(rf"Handshake failed .*({reason})")
        wait_until(lambda: handshake.search(stack.agent.output()[output_before:]), 10, "gRPC's handshake log line")
    else:
        new = wait_until(lambda: _refusals(stack)[before:], 10, "the agent's refusal log line")
        assert re.search(reason, new[0][1]), new
    ch, stub = _agent_stub(stack, stack.certs, "controller")  # the trusted controller still gets in
    try:
        assert stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5).node == stack.agent_node
    finally:
        ch.close()


def test_trainer_plan_stream_over_tls(stack, rogue_certs):
    etcd = stack.etcd.client(cert="controller", user="tpflex-controller", password=PASSWORDS["tpflex-controller"])
    try:
        racks = [synthetic.rack("rk-tls", 2, 2)]
        synthetic.store_cluster(etcd, racks)
        spec = synthetic.job("job-tls", ["rk-tls"], racks[0].domain_size)
        etcd.put(keys.job_spec("job-tls"), codec.encode(spec))
        credential = Credentials(etcd).issue("job-tls", "test", "test")  # as RegisterJob issues it
    finally:
        etcd.close()
    endpoint = f"localhost:{stack.trainer_port}"
    client = ControlClient(ControlConfig(
        endpoints=(endpoint,), job="job-tls", rank=0, tls_ca_file=str(stack.certs / "ca.pem"),
        credential=credential,
    )).start()
    try:
        plan = client.wait_for_generation(1, timeout=30)
        assert plan is not None and plan.job == "job-tls" and plan.generation >= 1
    finally:
        client.close()
    request = controller_pb2.WatchPlanRequest(job="job-tls")
    for channel in (
        grpc.insecure_channel(endpoint),  # plaintext to a TLS port
        grpc.secure_channel(endpoint, channel_credentials(str(rogue_certs / "ca.pem"))),  # wrong CA
    ):
        with channel:
            with pytest.raises(grpc.RpcError) as exc:
                next(controller_pb2_grpc.TrainerStub(channel).WatchPlan(request, timeout=5))
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_controller_pushes_power_caps_to_the_agent_over_mtls(stack):
    """The whole path with TLS on: a job on the agent's rack, a drained GPU, the leader's
    re-plan boosts the surviving GPU and the controller's push reaches the agent (mTLS)."""
    ch, agent = _agent_stub(stack, stack.certs, "controller")
    try:
        devices = agent.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5).gpus
        tdp, low, high = devices[0].default_limit_w, devices[0].min_limit_w, devices[0].max_limit_w
        etcd = stack.etcd.client(cert="controller", user="tpflex-controller",
                                 password=PASSWORDS["tpflex-controller"])
        try:
            own = types_pb2.Rack(name="rack-sec", domain_size=2, power_budget_w=2 * tdp, gpu_tdp_w=tdp,
                                 gpu_min_w=low, gpu_max_w=high, nodes=[stack.agent_node], gpus_per_node=2)
            etcd.put(keys.rack("rack-sec"), codec.encode(own))
            synthetic.store_cluster(etcd, [synthetic.rack("rack-far", 1, 2, tdp_w=tdp, min_w=low, max_w=high)])
            etcd.put(keys.job_spec("job-e2e"), codec.encode(synthetic.job("job-e2e", ["rack-sec", "rack-far"], 2)))
        finally:
            etcd.close()
        with stack.http() as http:
            plan = "/v1/jobs/job-e2e/plan"
            wait_until(lambda: http.get(plan).status_code == 200, 20, "the first plan")
            r = http.post(f"/v1/nodes/{stack.agent_node}/gpus/1/drain", json={"reason": "e2e"},
                          headers=_bearer(ADMIN_TOKEN))
            assert r.status_code == 202, r.text
            caps = wait_until(lambda: http.get(plan).json().get("power_caps"), 20, "a plan with power caps")

        def boosted():
            gpus = agent.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5).gpus
            return gpus[0].power_limit_w > tdp and gpus[0].power_limit_w
        limit = wait_until(boosted, 20, f"the agent applying the boost cap (plan caps {caps})")
        assert limit <= high
        # the controller's own push over mTLS succeeded: only an agent's answer to the push
        # completes the rollout's power_applied phase (the agent may also have taken the caps
        # from etcd first; the push then answers ALREADY_APPLIED)
        phase = re.compile(r'tpflex_reconfiguration_seconds_count\{phase="power_applied"\} ([0-9.]+)')
        with stack.http() as http:
            wait_until(lambda: (m := phase.search(http.get("/metrics").text)) and float(m.group(1)) >= 1,
                       20, "the controller's power_applied phase")
        assert "agent refused power plan" not in stack.controller.output()
    finally:
        ch.close()
