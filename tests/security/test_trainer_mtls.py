"""The controller's Trainer service with mutual TLS (trainer.client_ca_file): trainers that
present a certificate from the CA stream plans; others are refused and logged with the peer."""

from __future__ import annotations

import logging
import re

import grpc
import pytest
from tpflex_controller import synthetic
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2
from tpflex_proto.tls import ServerTls, channel_credentials
from tpflex_trainer.hooks.control import ControlClient, ControlConfig

from tests.security.stack import wait_until


@pytest.fixture
def mtls_trainer_server(etcd, certs):
    racks = [synthetic.rack("rk", 1, 2)]
    etcd.put(keys.job_spec("job-m"), codec.encode(synthetic.job("job-m", ["rk"], racks[0].domain_size)))
    etcd.put(keys.job_plan("job-m"), codec.encode(types_pb2.Plan(job="job-m", generation=3)))
    tls = ServerTls(str(certs / "controller.pem"), str(certs / "controller-key.pem"),
                    str(certs / "ca.pem"), frozenset({"tpflex-trainer"}))
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", tls=tls)
    server.start()
    try:
        yield port
    finally:
        server.stop(0).wait(5)


def test_a_trainer_with_its_certificate_streams_plans(mtls_trainer_server, certs):
    client = ControlClient(ControlConfig(
        endpoints=(f"127.0.0.1:{mtls_trainer_server}",), job="job-m", rank=0,
        tls_ca_file=str(certs / "ca.pem"), tls_cert_file=str(certs / "trainer.pem"),
        tls_key_file=str(certs / "trainer-key.pem"), tls_server_name="tpflex-controller",
    )).start()
    try:
        plan = client.wait_for_generation(3, timeout=20)
        assert plan is not None and plan.generation == 3
    finally:
        client.close()


@pytest.mark.parametrize("name", [None, "agent"])
def test_other_clients_are_refused_and_logged(mtls_trainer_server, certs, caplog, name):
    """No client certificate: refused in gRPC's handshake (UNAVAILABLE). A certificate of
    the CA whose name is not an allowed trainer: refused per call (PERMISSION_DENIED) and
    logged with the peer's address."""
    caplog.set_level(logging.WARNING, logger="tpflex_proto.tls")
    cert = (str(certs / f"{name}.pem"), str(certs / f"{name}-key.pem")) if name else (None, None)
    creds = channel_credentials(str(certs / "ca.pem"), *cert)
    with grpc.secure_channel(f"localhost:{mtls_trainer_server}", creds) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            next(controller_pb2_grpc.TrainerStub(ch).WatchPlan(
                controller_pb2.WatchPlanRequest(job="job-m"), timeout=5))
    if name is None:
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        return
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    lines = wait_until(lambda: [r.getMessage() for r in caplog.records if "refused" in r.getMessage()],
                       5, "the refusal log line")
    reason = "certificate CN 'tpflex-agent' is not an allowed client"
    assert re.search(rf"tls client refused service=trainer peer=127\.0\.0\.1:\d+ reason={reason}", lines[0]), lines


def test_the_hooks_read_a_renewed_client_certificate_for_their_next_channel(certs, rogue_certs, tmp_path):
    """The hooks' channels take their TLS credentials from tpflex_proto.tls (one
    implementation): a certificate replaced on disk is read again for the next channel;
    a half-written one keeps the last good credentials."""
    import shutil

    from tpflex_trainer.hooks import control

    for name in ("ca.pem", "trainer.pem", "trainer-key.pem"):
        shutil.copy(certs / name, tmp_path / name)
    config = ControlConfig(endpoints=("127.0.0.1:1",), job="j", rank=0, tls_ca_file=str(tmp_path / "ca.pem"),
                           tls_cert_file=str(tmp_path / "trainer.pem"), tls_key_file=str(tmp_path / "trainer-key.pem"))
    first, _ = control._tls(config)
    files = control._CREDENTIALS[(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)]
    assert control._tls(config)[0] is first and files.reloads == 0  # unchanged files: the same
    for name in ("trainer.pem", "trainer-key.pem"):  # renewed (another CA's pair stands in)
        shutil.copy(rogue_certs / name, tmp_path / name)
    renewed, _ = control._tls(config)
    assert renewed is not first and files.reloads == 1
    (tmp_path / "trainer-key.pem").write_text("not a key")  # mid-rotation
    assert control._tls(config)[0] is renewed and files.reloads == 1
