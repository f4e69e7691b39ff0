"""Certificate, key and CA files that cannot be used: refused at start with the setting's
name, and a rotation to them keeps the last good set (logged as a failure, not as a
reload); a client's certificate is read again when it changes."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tpflex_proto.tls import (
    ClientCertificateFiles,
    ServerTls,
    TlsFilesError,
    bind_grpc,
    channel_credentials,
    peer_address,
    server_interceptors,
)

from tests.controller.controller_harness import CONTROLLER_BIN

JUNK = "-----BEGIN CERTIFICATE-----\nnot base64\n"


def _serve(tls: ServerTls):
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=server_interceptors(tls, service="probe"))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server, port = bind_grpc(server, "127.0.0.1:0", tls, service="probe")
    server.start()
    return server, port


def _ok(port: int, creds: grpc.ChannelCredentials) -> bool:
    with grpc.secure_channel(f"localhost:{port}", creds) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
        return True


def _copy(src, dst, names=("agent.pem", "agent-key.pem", "ca.pem")) -> None:
    dst.mkdir(exist_ok=True)
    for f in names:  # as a rotation does: write aside, rename in
        shutil.copy(src / f, dst / f"{f}.new")
        (dst / f"{f}.new").replace(dst / f)


def test_a_rotation_to_unusable_files_keeps_the_last_good_set_and_says_so(certs, rogue_certs, tmp_path, caplog):
    live = tmp_path / "live"
    _copy(certs, live)
    server, port = _serve(ServerTls(str(live / "agent.pem"), str(live / "agent-key.pem"), str(live / "ca.pem")))
    good = channel_credentials(str(certs / "ca.pem"), str(certs / "controller.pem"), str(certs / "controller-key.pem"))
    caplog.set_level(logging.INFO, logger="tpflex_proto.tls")
    try:
        assert _ok(port, good)
        bad_sets = {
            "a key that does not match": lambda: _copy(rogue_certs, live, ("agent-key.pem",)),
            "a half-written certificate": lambda: (live / "agent.pem").write_text(
                (certs / "agent.pem").read_text()[:300]),
            "a CA file that is not PEM": lambda: (live / "ca.pem").write_text(JUNK),
        }
        for what, spoil in bad_sets.items():
            _copy(certs, live)
            assert _ok(port, good), what
            caplog.clear()
            spoil()
            assert _ok(port, good), what  # the last good set still serves
            messages = [r.getMessage() for r in caplog.records]
            assert any("tls certificate reload failed" in m for m in messages), (what, messages)
            assert not any("tls certificate reloaded" in m for m in messages), (what, messages)
        caplog.clear()
        _copy(rogue_certs, live)  # a good set of another CA: served from the next connection
        assert not _ok(port, good)
        rogue = channel_credentials(str(rogue_certs / "ca.pem"), str(rogue_certs / "controller.pem"),
                                    str(rogue_certs / "controller-key.pem"))
        assert _ok(port, rogue)
        assert any("tls certificate reloaded" in r.getMessage() for r in caplog.records)
    finally:
        server.stop(0).wait(5)


def test_unusable_files_at_start_are_a_tls_error_naming_the_file(certs, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text(JUNK)
    cert, key, ca = (str(certs / f) for f in ("agent.pem", "agent-key.pem", "ca.pem"))
    cases = [
        (ServerTls(str(junk), key), "junk.pem"),
        (ServerTls(cert, str(certs / "controller-key.pem")), "does not match|not a PEM"),
        (ServerTls(cert, key, str(junk)), "CA file"),
        (ServerTls(str(tmp_path), key), "cannot read certificate"),  # a directory
    ]
    for tls, message in cases:
        server = grpc.server(futures.ThreadPoolExecutor(1))
        with pytest.raises(TlsFilesError, match=message):
            bind_grpc(server, "127.0.0.1:0", tls, service="probe")
    with pytest.raises(TlsFilesError, match="CA file"):
        channel_credentials(str(junk))
    with pytest.raises(TlsFilesError, match="not a PEM"):
        channel_credentials(ca, cert, str(certs / "controller-key.pem"))


def test_a_client_certificate_is_read_again_when_its_files_change(certs, rogue_certs, tmp_path):
    """The controller's certificate towards the agents: renewed on disk (here: moved to
    another CA, as the agents were), the next channel uses it, without a restart."""
    server, port = _serve(ServerTls(str(rogue_certs / "agent.pem"), str(rogue_certs / "agent-key.pem"),
                                    str(rogue_certs / "ca.pem")))
    mine = tmp_path / "client"
    _copy(certs, mine, ("ca.pem", "controller.pem", "controller-key.pem"))
    files = ClientCertificateFiles(str(mine / "ca.pem"), str(mine / "controller.pem"), str(mine / "controller-key.pem"))
    try:
        assert not _ok(port, files.get())
        (mine / "controller-key.pem").write_text(JUNK)  # half-way: the last good set stays
        assert files.get() is not None and files.reloads == 0
        _copy(rogue_certs, mine, ("ca.pem", "controller.pem", "controller-key.pem"))
        assert _ok(port, files.get()) and files.reloads == 1
    finally:
        server.stop(0).wait(5)


def test_an_ipv6_peer_is_logged_as_host_and_port():
    assert peer_address("ipv6:%5B::1%5D:51110") == "[::1]:51110"
    assert peer_address("ipv4:127.0.0.1:5000") == "127.0.0.1:5000"
    assert peer_address("unix:/run/x.sock") == "unix:/run/x.sock"


def test_unusable_secret_and_certificate_files_exit_2_naming_the_setting(tmp_path, certs):
    """Files that exist but cannot be used are refused at start with the setting's name
    (exit 2, no traceback): before, the controller started and then crash-looped its REST
    child (a REST certificate that is not PEM), retried etcd forever ("empty address list",
    a CA file that is not PEM), blamed the port (a trainer key that does not match its
    certificate: "cannot bind"), or died with a traceback (a directory, a password file
    that is not UTF-8)."""
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")
    latin = tmp_path / "password"
    latin.write_bytes(b"p\xe4ssword\n")
    cert, key, ca = (str(certs / f) for f in ("controller.pem", "controller-key.pem", "ca.pem"))
    other_key = str(certs / "agent-key.pem")
    cases = [
        ({"TPFLEX_REST__TLS_CERT_FILE": str(junk), "TPFLEX_REST__TLS_KEY_FILE": key}, "rest.tls_cert_file"),
        ({"TPFLEX_ETCD__CA_FILE": str(junk)}, "etcd.ca_file"),
        ({"TPFLEX_ETCD__PASSWORD_FILE": str(latin), "TPFLEX_ETCD__USERNAME": "u"}, "etcd.password_file"),
        ({"TPFLEX_AGENTS__CA_FILE": str(junk)}, "agents.ca_file"),
        ({"TPFLEX_TRAINER__TLS_CERT_FILE": cert, "TPFLEX_TRAINER__TLS_KEY_FILE": other_key},
         "trainer.tls_cert_file"),
        ({"TPFLEX_TRAINER__TLS_CERT_FILE": cert, "TPFLEX_TRAINER__TLS_KEY_FILE": key,
          "TPFLEX_TRAINER__CLIENT_CA_FILE": str(junk)}, "client_ca_file"),
    ]
    for env, setting in cases:
        # etcd at an address nobody listens on: each case must stop before etcd matters
        run = subprocess.run([CONTROLLER_BIN, "--etcd", "127.0.0.1:9", "--rest-listen", "127.0.0.1:0",
                              "--trainer-listen", "127.0.0.1:0"], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, (setting, run.returncode, run.stderr[-2000:])
        assert setting in run.stderr and "Traceback" not in run.stderr, (setting, run.stderr[-2000:])
        assert "cannot bind" not in run.stderr, (setting, run.stderr[-2000:])


def test_the_agent_refuses_unusable_files_before_it_serves(certs, tmp_path, monkeypatch, capsys):
    """Exit 2 with the setting's name: a gRPC key that does not match its certificate was
    reported as "cannot bind", and an etcd CA or password file that could not be used
    raised a traceback after the agent was already serving."""
    from tpflex_agent.main import main

    for name in list(os.environ):
        if name.startswith("TPFLEX_"):
            monkeypatch.delenv(name)
    junk = tmp_path / "junk.pem"
    junk.write_text(JUNK)
    latin = tmp_path / "password"
    latin.write_bytes(b"p\xe4ssword\n")
    tls = ["--backend", "sim", "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    env_tls = {"TPFLEX_GRPC__TLS_CERT_FILE": str(certs / "agent.pem"),
               "TPFLEX_GRPC__TLS_KEY_FILE": str(certs / "agent-key.pem")}
    cases = [
        ({**env_tls, "TPFLEX_GRPC__TLS_KEY_FILE": str(certs / "controller-key.pem")}, "grpc.tls_cert_file"),
        ({**env_tls, "TPFLEX_GRPC__CLIENT_CA_FILE": str(junk)}, "client_ca_file"),
        ({**env_tls, "TPFLEX_ETCD__ENDPOINTS": "127.0.0.1:9", "TPFLEX_ETCD__CA_FILE": str(junk)}, "etcd.ca_file"),
        ({**env_tls, "TPFLEX_ETCD__ENDPOINTS": "127.0.0.1:9", "TPFLEX_ETCD__USERNAME": "u",
          "TPFLEX_ETCD__PASSWORD_FILE": str(latin)}, "etcd.password_file"),
    ]
    for env, setting in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert main(tls) == 2, setting
        err = capsys.readouterr().err
        assert setting in err and "Traceback" not in err and "cannot bind" not in err, (setting, err)
