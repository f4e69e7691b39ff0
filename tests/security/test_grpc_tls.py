"""gRPC's own mutual TLS on a real gRPC server (tpflex_proto.tls): streams pass with a
certificate of the CA and an allowed name; a plaintext client, one without a certificate
and one of another CA are refused in the handshake; a certificate of the CA with a name
not allowed is refused per call and logged with the peer's address; rotated certificate
files are used by the next connection without a restart; a taken port is an OSError with
the address."""

from __future__ import annotations

import logging
import re
import shutil
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tpflex_proto.tls import ServerTls, bind_grpc, channel_credentials, server_interceptors

from tests.security.stack import wait_until

ALLOWED = frozenset({"tpflex-controller"})


def _server(tls: ServerTls, listen: str = "127.0.0.1:0"):
    interceptors = server_interceptors(tls, service="probe")
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=interceptors)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server, port = bind_grpc(server, listen, tls, service="probe")
    return server, port, servicer


def _tls(certs, names=ALLOWED) -> ServerTls:
    return ServerTls(str(certs / "agent.pem"), str(certs / "agent-key.pem"), str(certs / "ca.pem"), names)


def _channel(port: int, ca, who: str | None) -> grpc.Channel:
    cert = (str(ca / f"{who}.pem"), str(ca / f"{who}-key.pem")) if who else (None, None)
    creds = channel_credentials(str(ca / "ca.pem"), *cert)
    return grpc.secure_channel(f"localhost:{port}", creds)


def _check(ch: grpc.Channel) -> health_pb2.HealthCheckResponse:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_streams_pass_and_stop_closes_the_listener(certs):
    server, port, servicer = _server(_tls(certs))
    server.start()
    with _channel(port, certs, "controller") as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="x"), timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        servicer.set("x", health_pb2.HealthCheckResponse.SERVING)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        server.stop(0.5).wait(10)
        with pytest.raises(grpc.RpcError):
            next(watch)  # the stream ends with the server
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.parametrize("who", ["plaintext", None, "rogue-controller"])
def test_clients_without_a_certificate_of_the_ca_are_refused_in_the_handshake(certs, rogue_certs, who):
    server, port, _ = _server(_tls(certs))
    server.start()
    try:
        if who == "plaintext":
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        elif who is None:
            ch = _channel(port, certs, None)
        else:  # the same names, signed by a CA the server does not trust
            creds = channel_credentials(str(certs / "ca.pem"), str(rogue_certs / "controller.pem"),
                                        str(rogue_certs / "controller-key.pem"))
            ch = grpc.secure_channel(f"localhost:{port}", creds)
        with ch, pytest.raises(grpc.RpcError) as exc:
            _check(ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        with _channel(port, certs, "controller") as ok:  # the trusted client still gets in
            assert _check(ok).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0).wait(5)


def test_a_name_not_allowed_is_refused_per_call_and_logged_with_the_peer(certs, caplog):
    caplog.set_level(logging.WARNING, logger="tpflex_proto.tls")
    server, port, _ = _server(_tls(certs))
    server.start()
    try:
        with _channel(port, certs, "trainer") as ch, pytest.raises(grpc.RpcError) as exc:
            _check(ch)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        lines = wait_until(lambda: [r.getMessage() for r in caplog.records], 5, "a refusal line")
        assert re.fullmatch(r"tls client refused service=probe peer=127\.0\.0\.1:\d+ "
                            r"reason=certificate CN 'tpflex-trainer' is not an allowed client", lines[0]), lines
    finally:
        server.stop(0).wait(5)
    # without allowed names every certificate of the CA gets in
    server, port, _ = _server(_tls(certs, frozenset()))
    server.start()
    try:
        with _channel(port, certs, "trainer") as ch:
            assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0).wait(5)


def test_rotated_certificate_files_serve_the_next_connection(certs, rogue_certs, tmp_path):
    """The files are read again when they change: after the server's certificate, key and
    client CA are replaced by another CA's, clients of that CA get in, and the old ones
    no longer do, without a restart."""
    live = tmp_path / "live"
    live.mkdir()
    for f in ("agent.pem", "agent-key.pem", "ca.pem"):
        shutil.copy(certs / f, live / f)
    server, port, _ = _server(_tls(live))
    server.start()
    try:
        with _channel(port, certs, "controller") as ch:
            assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING
        for f in ("agent.pem", "agent-key.pem", "ca.pem"):  # rotate: write aside, rename in
            shutil.copy(rogue_certs / f, live / f"{f}.new")
            (live / f"{f}.new").replace(live / f)
        with _channel(port, rogue_certs, "controller") as ch:
            assert _check(ch).status == health_pb2.HealthCheckResponse.SERVING
        with _channel(port, certs, "controller") as ch, pytest.raises(grpc.RpcError) as exc:
            _check(ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0).wait(5)


def test_a_taken_port_is_an_os_error_naming_the_address(certs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            _server(_tls(certs), f"127.0.0.1:{port}")
