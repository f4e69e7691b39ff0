"""TLS for tpflex's gRPC servers and channels, shared by the controller and the agent.

All of it is gRPC's own TLS. Plain TLS: a server certificate only. Mutual TLS (with
``client_ca_file``): clients must present a certificate signed by that CA
(``require_client_auth``), checked in gRPC's handshake; the allowed certificate names
(``client_names``, the CN) are checked per call by :class:`PeerNameCheck`, which logs each
refusal with the real peer address (``tls client refused service=... peer=HOST:PORT
reason=...``). A client that fails the handshake itself (no certificate, another CA) is
refused by gRPC before any call, so only gRPC's own log says so.

The server's certificate, key and client CA are read again when one of the files changes
(checked at each new connection's handshake): rotating them needs no restart.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

log = logging.getLogger("tpflex_proto.tls")


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


class CertificateFiles:
    """The server's certificate configuration, read again when a file changes: gRPC asks
    ``fetch`` at each new connection's handshake (None = keep the current one). A file
    that cannot be read, or a pair gRPC rejects, keeps the last good configuration."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p]
        self._lock = threading.Lock()
        self._stamp = self._stamps()
        self.initial = self._config()
        self.reloads = 0

    def _stamps(self) -> tuple:
        out = []
        for path in self._paths:
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def _config(self):
        t = self._tls
        return grpc.ssl_server_certificate_configuration(
            [(read_file(t.key_file), read_file(t.cert_file))],
            root_certificates=read_file(t.client_ca_file) if t.client_ca_file else None,
        )

    def fetch(self):
        with self._lock:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                config = self._config()
            except (OSError, ValueError) as exc:
                log.warning("tls certificate reload failed cert=%s error=%s", self._tls.cert_file, exc)
                return None
            self.reloads += 1
            log.info("tls certificate reloaded cert=%s reloads=%d", self._tls.cert_file, self.reloads)
            return config


def server_credentials(tls: ServerTls) -> tuple[grpc.ServerCredentials, CertificateFiles]:
    """gRPC's TLS credentials for ``tls``, reloading changed files; with a client CA the
    client must present a certificate it signed."""
    files = CertificateFiles(tls)
    creds = grpc.dynamic_ssl_server_credentials(
        files.initial, files.fetch, require_client_authentication=bool(tls.client_ca_file)
    )
    return creds, files


def peer_address(peer: str) -> str:
    """gRPC's ``context.peer()`` (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``) as
    HOST:PORT."""
    kind, _, rest = peer.partition(":")
    return rest if kind in ("ipv4", "ipv6") and rest else peer


class PeerNameCheck(grpc.ServerInterceptor):
    """Refuses a call whose client certificate's CN is not in ``names`` (PERMISSION_DENIED)
    and logs it with the peer's address; every call passes when ``names`` is empty."""

    def __init__(self, names: frozenset[str], service: str) -> None:
        self._names = names
        self._service = service
        self.refused = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not self._names:
            return handler
        return _guarded(handler, self._check)

    def _check(self, context: grpc.ServicerContext) -> None:
        names = context.auth_context().get("x509_common_name") or [b""]
        name = names[0].decode(errors="replace")
        if name in self._names:
            return
        self.refused += 1
        reason = f"certificate CN {name!r} is not an allowed client"
        log.warning("tls client refused service=%s peer=%s reason=%s",
                    self._service, peer_address(context.peer()), reason)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)


def _guarded(handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], None]):
    """``handler`` with ``check(context)`` run before its behaviour."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attr, make in kinds:
        behaviour = getattr(handler, attr)
        if behaviour is not None:
            def guarded(request, context, _behaviour=behaviour):
                check(context)
                return _behaviour(request, context)

            return make(guarded, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


def server_interceptors(tls: ServerTls | None, *, service: str) -> list[grpc.ServerInterceptor]:
    """The interceptors a server with ``tls`` needs: the name check under mutual TLS with
    allowed names (pass them to ``grpc.server(..., interceptors=...)``)."""
    if tls is None or not tls.client_ca_file or not tls.client_names:
        return []
    return [PeerNameCheck(tls.client_names, service)]


def bind_grpc(server: grpc.Server, listen: str, tls: ServerTls | None, *, service: str) -> tuple[grpc.Server, int]:
    """Bind ``server`` to ``listen`` with ``tls``: none -> plaintext, no client CA -> TLS,
    a client CA -> mutual TLS (build the server with ``server_interceptors(tls)`` for the
    name check). Returns the server and the bound port; raises OSError naming the address
    when it cannot bind."""
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, server_credentials(tls)[0])
    except RuntimeError as exc:
        raise OSError(f"cannot bind {listen}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind {listen}")
    return server, port
