#!/usr/bin/env python3
"""The agent pod's readiness probe: the standard gRPC health check (grpc.health.v1) of the
agent's own gRPC server, over the mutual TLS that server requires.

Kubernetes' built-in ``grpc`` probe speaks plaintext only, and the agent's port takes
mutual TLS only, so the kubelet runs this instead (an ``exec`` probe, installed in the
agent image as /opt/tpflex/bin/grpc-health-probe). Exit status 0: the service answered
SERVING; 1: anything else (NOT_SERVING while the agent shuts down, no answer, a refused
handshake or certificate), with the reason on stderr.

Usage: grpc-health-probe --addr 127.0.0.1:8472 --ca ca.pem --cert agent.pem --key agent-key.pem
       [--server-name tpflex-agent] [--service tpflex.v1.Agent] [--timeout 3]
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grpc-health-probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", required=True, help="HOST:PORT of the gRPC server")
    p.add_argument("--ca", required=True, help="CA certificate that signed the server's")
    p.add_argument("--cert", required=True, help="client certificate (mutual TLS)")
    p.add_argument("--key", required=True, help="its private key")
    p.add_argument("--server-name", default="tpflex-agent", help="name to check in the server's certificate")
    p.add_argument("--service", default="tpflex.v1.Agent", help="health service name ('' = the server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    a = p.parse_args(argv)
    try:
        with open(a.ca, "rb") as ca, open(a.cert, "rb") as cert, open(a.key, "rb") as key:
            creds = grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())
    except OSError as exc:
        print(f"grpc-health-probe: {exc}", file=sys.stderr)
        return 1
    options = [("grpc.ssl_target_name_override", a.server_name)] if a.server_name else []
    with grpc.secure_channel(a.addr, creds, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)
        except grpc.RpcError as exc:
            print(f"grpc-health-probe: {a.addr}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"grpc-health-probe: {a.addr}: service {a.service!r} is {status}", file=sys.stderr)
        return 1
    print(f"{a.addr}: {a.service or '(server)'} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
