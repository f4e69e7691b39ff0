"""The mTLS gate in front of a real gRPC server (tpflex_proto.tls): streams pass through,
non-TLS clients are refused and logged, stopping the server closes the listener and frees
the private socket directory, a taken port is an OSError with the address."""

from __future__ import annotations

import logging
import os
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tpflex_proto.tls import GatedServer, ServerTls, bind_grpc, channel_credentials

from tests.security.stack import wait_until


def _server(certs, listen: str = "127.0.0.1:0"):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tls = ServerTls(str(certs / "agent.pem"), str(certs / "agent-key.pem"), str(certs / "ca.pem"))
    server, port = bind_grpc(server, listen, tls, service="probe")
    return server, port, servicer


def _client(certs, port: int) -> grpc.Channel:
    creds = channel_credentials(str(certs / "ca.pem"), str(certs / "controller.pem"),
                                str(certs / "controller-key.pem"))
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def test_streams_pass_the_gate_and_stop_closes_it(certs):
    server, port, servicer = _server(certs)
    assert isinstance(server, GatedServer)
    socket_dir = server._socket_dir
    assert oct(os.stat(socket_dir).st_mode & 0o777) == "0o700"
    server.start()
    with _client(certs, port) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="x"), timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        servicer.set("x", health_pb2.HealthCheckResponse.SERVING)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        server.stop(0.5).wait(10)
        with pytest.raises(grpc.RpcError):
            next(watch)  # the stream ends with the server
    wait_until(lambda: not os.path.exists(socket_dir), 10, "the socket directory removed")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_plaintext_client_is_refused_and_logged(certs, caplog):
    caplog.set_level(logging.WARNING, logger="tpflex_proto.tls")
    server, port, _ = _server(certs)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as exc:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        lines = wait_until(lambda: [r.getMessage() for r in caplog.records], 5, "a refusal line")
        assert lines[0].startswith("tls client refused service=probe peer=127.0.0.1:")
        assert server.gate.refused >= 1
    finally:
        server.stop(0).wait(5)


def test_a_taken_port_is_an_os_error_naming_the_address(certs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            _server(certs, f"127.0.0.1:{port}")
