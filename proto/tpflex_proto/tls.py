"""TLS for tpflex's gRPC servers and channels, shared by the controller and the agent.

Plain TLS (a server certificate only) is gRPC's own. Mutual TLS (clients must present a
certificate signed by ``client_ca_file``) is terminated by :class:`TlsGate` in front of
the gRPC server, which then listens on a private unix socket: gRPC's own TLS refuses an
untrusted client without saying who it was, the gate logs every refusal with the peer's
address and the reason (``tls client refused service=... peer=HOST:PORT reason=...``)
and can restrict the accepted certificate common names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
from dataclasses import dataclass, field

import grpc

log = logging.getLogger("tpflex_proto.tls")

_HANDSHAKE_TIMEOUT_S = 10.0
_CHUNK = 256 * 1024


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key; with ``client_ca_file`` clients need a certificate
    signed by that CA (and, when ``client_names`` is not empty, one of those CNs)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""
    client_names: frozenset[str] = field(default_factory=frozenset)


def channel_credentials(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca_file``; present ``cert_file``/``key_file`` if given."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca_file),
        private_key=read_file(key_file) if key_file else None,
        certificate_chain=read_file(cert_file) if cert_file else None,
    )


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """The gate's TLS context: TLS >= 1.2, ALPN h2 (gRPC needs it), client certificates
    required and verified against ``tls.client_ca_file``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    ctx.load_verify_locations(cafile=tls.client_ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _common_name(cert: dict | None) -> str:
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return ""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or exc.__class__.__name__
    if isinstance(exc, TimeoutError):
        return "handshake timeout"
    return str(exc) or exc.__class__.__name__


def _format_peer(peer) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in str(peer[0]) else str(peer[0])
        return f"{host}:{peer[1]}"
    return str(peer)


class TlsGate:
    """Accepts TLS connections on ``listen`` (HOST:PORT, port 0 = any free port), verifies
    the client certificate and relays the bytes to the gRPC server on ``backend`` (a unix
    socket path). One asyncio thread serves every connection."""

    def __init__(self, listen: str, backend: str, tls: ServerTls, *, service: str) -> None:
        self._host, _, port = listen.rpartition(":")
        self._host = self._host.strip("[]")
        self._port = int(port)
        self._backend = backend
        self._tls = tls
        self._ctx = server_context(tls)
        self._service = service
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tls-gate-{service}", daemon=True)
        self.refused = 0

    def start(self) -> int:
        """Bind and serve; returns the bound port. Raises OSError if it cannot bind."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.setblocking(False)
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, sock=sock, limit=_CHUNK), self._loop
        )
        self._server = fut.result(timeout=10)
        return sock.getsockname()[1]

    def stop_accepting(self) -> None:
        if self._server is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._server.close)

    def close(self) -> None:
        """Stop accepting and drop every relayed connection."""
        if not self._loop.is_running():
            return

        async def _shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _format_peer(writer.get_extra_info("peername"))
        try:
            await writer.start_tls(self._ctx, ssl_handshake_timeout=_HANDSHAKE_TIMEOUT_S)
            name = _common_name(writer.get_extra_info("peercert"))
            if self._tls.client_names and name not in self._tls.client_names:
                raise PermissionError(f"certificate CN {name!r} is not an allowed client")
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self.refused += 1
            log.warning("tls client refused service=%s peer=%s reason=%s", self._service, peer, _reason(exc))
            writer.transport.abort()
            return
        log.debug("tls client accepted service=%s peer=%s cn=%s", self._service, peer, name)
        try:
            b_reader, b_writer = await asyncio.open_unix_connection(self._backend, limit=_CHUNK)
        except OSError as exc:
            log.warning("tls gate backend unreachable service=%s reason=%s", self._service, exc)
            writer.transport.abort()
            return
        pipes = [
            asyncio.ensure_future(_pipe(reader, b_writer)),
            asyncio.ensure_future(_pipe(b_reader, writer)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in pipes:
                p.cancel()
            for w in (writer, b_writer):
                w.transport.abort()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
    except (OSError, ssl.SSLError):
        pass


class GatedServer:
    """A ``grpc.Server`` behind a :class:`TlsGate`; ``stop()`` also stops the gate."""

    def __init__(self, server: grpc.Server, gate: TlsGate, socket_dir: str) -> None:
        self._server = server
        self.gate = gate
        self._socket_dir = socket_dir

    def __getattr__(self, name: str):
        return getattr(self._server, name)

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float | None) -> threading.Event:
        self.gate.stop_accepting()
        done = self._server.stop(grace)

        def _finish() -> None:
            done.wait()
            self.gate.close()
            shutil.rmtree(self._socket_dir, ignore_errors=True)

        threading.Thread(target=_finish, name="tls-gate-stop", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)


def bind_grpc(
    server: grpc.Server, listen: str, tls: ServerTls | None, *, service: str
) -> tuple[grpc.Server | GatedServer, int]:
    """Bind ``server`` to ``listen`` with ``tls``: none -> plaintext, no client CA ->
    gRPC's TLS, a client CA -> mutual TLS through a :class:`TlsGate`. Returns the server
    to start/stop (the gated one for mTLS) and the bound port; raises OSError."""
    if tls is None:
        return server, server.add_insecure_port(listen)
    if not tls.client_ca_file:
        creds = grpc.ssl_server_credentials([(read_file(tls.key_file), read_file(tls.cert_file))])
        return server, server.add_secure_port(listen, creds)
    socket_dir = tempfile.mkdtemp(prefix=f"tpflex-{service}-")
    os.chmod(socket_dir, 0o700)
    backend = os.path.join(socket_dir, "grpc.sock")
    if not server.add_insecure_port(f"unix:{backend}"):
        raise OSError(f"cannot bind the {service} gRPC server to unix:{backend}")
    gate = TlsGate(listen, backend, tls, service=service)
    try:
        port = gate.start()
    except OSError as exc:
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise OSError(f"cannot bind {listen}: {exc.strerror or exc}") from None
    return GatedServer(server, gate, socket_dir), port
