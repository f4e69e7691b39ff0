"""A loopback TCP proxy that a test can cut: ``cut()`` drops every connection and refuses
new ones (a network partition between one process and etcd), ``heal()`` lets them in."""

from __future__ import annotations

import socket
import threading

from tests.support.ports import free_ports


class CuttableProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.port = free_ports(1)[0]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._listener.close()
