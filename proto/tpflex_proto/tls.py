"""TLS for tpflex's gRPC servers and channels, shared by the controller and the agent.

All of it is gRPC's own TLS. Plain TLS: a server certificate only. Mutual TLS (with
``client_ca_file``): clients must present a certificate signed by that CA
(``require_client_auth``), checked in gRPC's handshake; the allowed certificate names
(``client_names``, the CN) are checked per call by :class:`PeerNameCheck`, which logs each
refusal with the real peer address (``tls client refused service=... peer=HOST:PORT
reason=...``). A client that fails the handshake itself (no certificate, another CA) is
refused by gRPC before any call, so only gRPC's own log says so.

The server's certificate, key and client CA are read again when one of the files changes
(checked at each new connection's handshake): rotating them needs no restart. New files
are checked first (PEM that parses, a key that matches the certificate, a CA file holding
a certificate); a set that fails keeps the last good one, with a warning. A client's
certificate is read again the same way when it opens a new channel
(:class:`ClientCertificateFiles`).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

log = logging.getLogger("tpflex_proto.tls")


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class TlsFilesError(ValueError):
    """A certificate, key or CA file that cannot be used (the message names it and why)."""


class _FilesChanged(TlsFilesError):
    """The files changed while they were read (a rotation in progress): look again next time."""


def _read(path: str, what: str) -> bytes:
    try:
        return read_file(path)
    except OSError as exc:
        raise TlsFilesError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


def _check_pem(cert_file: str | None, key_file: str | None, ca_file: str | None) -> None:
    """Raises TlsFilesError unless ``cert_file`` and ``key_file`` are a PEM certificate
    (chain) and the unencrypted private key that matches it, and ``ca_file`` holds at least
    one PEM certificate (OpenSSL's checks, as gRPC's handshake would make them)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert_file and key_file:
        try:  # a password callback that refuses: an encrypted key fails instead of prompting
            ctx.load_cert_chain(cert_file, key_file, password=lambda: b"")
        except (ssl.SSLError, OSError) as exc:
            raise TlsFilesError(f"certificate {cert_file!r} and key {key_file!r} are not a PEM"
                                f" certificate and the unencrypted key that matches it: {exc}") from None
    if ca_file:
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsFilesError(f"CA file {ca_file!r} holds no usable PEM certificate: {exc}") from None


def _read_checked(files: list[tuple[str, str]], cert_file: str | None, key_file: str | None,
                  ca_file: str | None) -> list[bytes]:
    """The bytes of ``files`` ((path, what) pairs), checked by :func:`_check_pem`; raises
    TlsFilesError when a file is unusable or changed while it was checked (a rotation in
    progress: the next look finds it settled)."""
    data = [_read(path, what) for path, what in files]
    _check_pem(cert_file, key_file, ca_file)
    if [_read(path, what) for path, what in files] != data:
        raise _FilesChanged(f"{', '.join(p for p, _ in files)} changed while being read; retried at the next use")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key; with ``client_ca_file`` clients need a certificate
    signed by that CA (and, when ``client_names`` is not empty, one of those CNs)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""
    client_names: frozenset[str] = field(default_factory=frozenset)


def check_client_files(ca_file: str, cert_file: str | None = None, key_file: str | None = None) -> None:
    """Raises TlsFilesError unless ``ca_file`` (and ``cert_file``/``key_file`` when given)
    can be read and are usable PEM: a client's files checked at start, not at its first
    connection."""
    files = [(ca_file, "CA file")] + ([(cert_file, "certificate"), (key_file, "key")] if cert_file and key_file else [])
    _read_checked(files, cert_file, key_file, ca_file)


def check_server_files(cert_file: str, key_file: str) -> None:
    """Raises TlsFilesError unless ``cert_file``/``key_file`` are a readable PEM certificate
    and its key (a server that loads them itself, such as uvicorn's)."""
    _read_checked([(cert_file, "certificate"), (key_file, "key")], cert_file, key_file, None)


def channel_credentials(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca_file``; present ``cert_file``/``key_file`` if given.
    Raises TlsFilesError when a file is unreadable or not usable PEM."""
    files = [(ca_file, "CA file")] + ([(cert_file, "certificate"), (key_file, "key")] if cert_file and key_file else [])
    data = _read_checked(files, cert_file, key_file, ca_file)
    return grpc.ssl_channel_credentials(
        root_certificates=data[0],
        private_key=data[2] if len(data) == 3 else None,
        certificate_chain=data[1] if len(data) == 3 else None,
    )


def _stamps(paths: list[str]) -> tuple:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class ClientCertificateFiles:
    """A client's TLS credentials, read again when one of its files changes: ``get()`` at
    each new channel (a renewed client certificate, or a new CA, is used without a
    restart; channels already open keep theirs). A set of files that fails the checks keeps
    the last good credentials, with a warning."""

    def __init__(self, ca_file: str, cert_file: str | None = None, key_file: str | None = None) -> None:
        self._args = (ca_file, cert_file, key_file)
        self._paths = [p for p in self._args if p]
        self._lock = threading.Lock()
        self._stamp = _stamps(self._paths)
        self._creds = channel_credentials(*self._args)  # TlsFilesError: refused at start
        self.reloads = 0

    def get(self) -> grpc.ChannelCredentials:
        with self._lock:
            stamp = _stamps(self._paths)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._creds = channel_credentials(*self._args)
                except TlsFilesError as exc:
                    log.warning("tls client certificate reload failed error=%s", exc)
                    if isinstance(exc, _FilesChanged):
                        self._stamp = None  # mid-rotation: read them again next time
                else:
                    self.reloads += 1
                    log.info("tls client certificate reloaded cert=%s reloads=%d", self._args[1] or "",
                             self.reloads)
            return self._creds


class CertificateFiles:
    """The server's certificate configuration, read again when a file changes: gRPC asks
    ``fetch`` at each new connection's handshake (None = keep the current one). A file
    that cannot be read, or a set that fails the checks (a key that does not match the
    certificate, a half-written PEM), keeps the last good configuration, with a warning.
    The first read raises TlsFilesError instead."""

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p]
        self._lock = threading.Lock()
        self._stamp = _stamps(self._paths)
        self.initial = self._config()
        self.reloads = 0

    def _config(self):
        t = self._tls
        files = [(t.cert_file, "certificate"), (t.key_file, "key")]
        if t.client_ca_file:
            files.append((t.client_ca_file, "client CA file"))
        data = _read_checked(files, t.cert_file, t.key_file, t.client_ca_file or None)
        return grpc.ssl_server_certificate_configuration(
            [(data[1], data[0])], root_certificates=data[2] if t.client_ca_file else None,
        )

    def fetch(self):
        with self._lock:
            stamp = _stamps(self._paths)
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                config = self._config()
            except TlsFilesError as exc:
                log.warning("tls certificate reload failed cert=%s error=%s", self._tls.cert_file, exc)
                if isinstance(exc, _FilesChanged):
                    self._stamp = None  # mid-rotation: read them again at the next handshake
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
    """gRPC's ``context.peer()`` (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``; gRPC
    percent-encodes the brackets: ``ipv6:%5B::1%5D:5000``) as HOST:PORT."""
    kind, _, rest = peer.partition(":")
    return urllib.parse.unquote(rest) if kind in ("ipv4", "ipv6") and rest else peer


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
    name check). Returns the server and the bound port; raises TlsFilesError naming the
    file when a certificate, key or CA file is unusable, OSError naming the address when it
    cannot bind."""
    creds = server_credentials(tls)[0] if tls is not None else None
    try:
        if creds is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, creds)
    except RuntimeError as exc:
        raise OSError(f"cannot bind {listen}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind {listen}")
    return server, port
