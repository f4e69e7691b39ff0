"""The REST API in its own process, so that no number of REST clients slows a decision
(the decision loop and REST do not share a GIL).

The controller binds the REST socket (a bad address still exits 2 at start, and port 0
works) and runs :class:`RestSupervisor`: it starts ``python -m
tpflex_controller.api.process`` with the listening socket and one end of a socket pair
(api/link.py) as inherited file descriptors and the effective settings on stdin, restarts
it (jittered backoff) when it dies, and stops it with SIGTERM. The child has its own etcd
client and informer and a read-only view; writes (overrides, drains, pins, specs) go to
etcd as before and the leader reacts to them. The child exits when its parent is gone.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

from prometheus_client import CollectorRegistry
from tpflex_proto.backoff import Backoff

from tpflex_controller.api.link import LinkClient, LinkServer
from tpflex_controller.cpus import pin_process
from tpflex_controller.periodic import Periodic
from tpflex_controller.settings import ControllerSettings
from tpflex_controller.steps import StepStats

log = logging.getLogger(__name__)


class RestSupervisor:
    """Keeps one REST child serving ``sock``; ``start()``, ``stop()``."""

    def __init__(self, settings: ControllerSettings, sock: socket.socket, registry: CollectorRegistry,
                 steps: StepStats | None) -> None:
        self.settings, self.sock, self.registry, self.steps = settings, sock, registry, steps
        self.port = sock.getsockname()[1]
        self.child: subprocess.Popen | None = None
        self._link: LinkServer | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rest-supervisor", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        mine, theirs = socket.socketpair()
        fds = (self.sock.fileno(), theirs.fileno())
        cmd = [sys.executable, "-m", "tpflex_controller.api.process",
               "--listen-fd", str(fds[0]), "--link-fd", str(fds[1]), "--parent-pid", str(os.getpid())]
        child = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.PIPE)
        theirs.close()
        self._link = LinkServer(mine, self.registry, self.steps)
        child.stdin.write(self.settings.model_dump_json().encode())
        child.stdin.close()
        self.child = child
        log.info("rest process started pid=%d port=%d", child.pid, self.port)

    def _run(self) -> None:
        backoff = Backoff(0.2, 5.0)
        while not self._stop.is_set():
            code = self.child.wait()
            if self._stop.is_set():
                return
            log.warning("rest process exited; restarting pid=%d code=%d", self.child.pid, code)
            self._link.close()
            while not self._stop.wait(backoff.next()):
                try:
                    self._spawn()
                    break
                except OSError as exc:
                    log.error("rest process cannot start; retrying error=%s", exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("rest process did not stop; killing pid=%d", child.pid)
                child.kill()
                child.wait(timeout)
        if self._link is not None:
            self._link.close()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        self.sock.close()


# ---- the child ----


def _serve(settings: ControllerSettings, listen_fd: int, link_fd: int, parent: int) -> int:
    import uvicorn

    from tpflex_controller.api import ApiDeps, create_app, load_tokens, stalls
    from tpflex_controller.api.cache import ApiStateCache
    from tpflex_controller.api.prerender import Prerenderer
    from tpflex_controller.api.respcache import ResponseCacheCollector
    from tpflex_controller.main import create_etcd
    from tpflex_controller.store import Store

    r = settings.rest
    link = LinkClient(socket.socket(fileno=link_fd))
    registry = CollectorRegistry()
    tokens = load_tokens(r.admin_tokens_file or None, r.readonly_tokens_file or None,
                         protect_reads=r.protect_reads)
    etcd = create_etcd(settings)
    stall = stalls.from_env()  # TPFLEX_DEBUG_REST_STALLS: a debugging aid, off by default
    prerender: Prerenderer | None = None

    def warmed() -> None:  # after each (re-)list's rows and status index were rendered
        if prerender is not None:
            prerender.render_all()  # every rack's view, before clients ask
        settle_heap()

    cache = ApiStateCache(etcd, row_cache_nodes=r.row_cache_nodes, on_warm=warmed)
    prerender = Prerenderer(cache).start()  # then what each change alters
    # its own informer; the stall log times each batch folded
    cache.start(wrap=None if stall is None else (lambda handler: stalls.timed_handler(stall, handler)))
    full_gc = FullCollections().start()  # settle_heap turns the automatic ones off
    deps = ApiDeps(
        store=Store(etcd), etcd=etcd, tokens=tokens, registry=registry, steps=link,
        state=cache, max_in_flight=r.max_in_flight, busy_wait_s=r.busy_wait_s,
        max_body_bytes=r.max_body_bytes, max_bodies=r.max_concurrent_bodies,
        body_timeout_s=r.body_timeout_s, response_cache_entries=r.response_cache_entries,
        response_cache_bytes=r.response_cache_mb << 20, read_your_writes_s=r.read_your_writes_s,
        metrics_prefix=link.metrics_text,  # the controller's metrics, read at scrape time
    )
    registry.register(ResponseCacheCollector(deps.response_stats))
    app = create_app(deps)
    if stall is not None:
        app = stalls.SlowRequests(app, log=stall)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", ssl_certfile=r.tls_cert_file or None,
        ssl_keyfile=r.tls_key_file or None, lifespan="off", timeout_keep_alive=r.keep_alive_s,
        timeout_graceful_shutdown=2,  # open console streams never end by themselves
    ))
    threading.Thread(target=_exit_with_parent, args=(parent, server), daemon=True).start()
    sock = socket.socket(fileno=listen_fd)
    try:
        server.run(sockets=[sock])  # SIGTERM/SIGINT: uvicorn stops gracefully
    finally:
        full_gc.stop()
        prerender.stop()
        cache.stop()
        etcd.close()
    return 0


FULL_COLLECTION_S = 300.0  # the REST process's full collections: one every 5 minutes
_NO_AUTOMATIC_FULL = 1_000_000  # gen-1 collections between automatic full ones: never


def settle_heap() -> None:
    """After the view is loaded and its rows rendered (``ApiStateCache(on_warm=)``): one
    full collection, then every object alive moves to the collector's permanent
    generation (``gc.freeze``), so that later full collections do not walk the view of
    the whole cluster. Under the load benchmark each walk of it (130,000 to 280,000
    objects) took 77 to 293 ms with the GIL held (TPFLEX_DEBUG_REST_STALLS), stalling
    every request in flight, and found 0 to 5 unreachable objects: the view makes no
    cyclic garbage, and frozen objects are still freed by reference counting when a
    change or a re-list replaces them.

    Then automatic full collections stop (young collections go on): with the view
    frozen, CPython's rule that holds a full collection back until the objects promoted
    since the last one reach a quarter of the long-lived ones no longer held, and one
    ran every ~3 s under the load benchmark, 57 to 335 ms each over ~40,000 objects,
    collecting nothing (``bench/load.py`` with the stall log). :class:`FullCollections`
    runs them on a timer instead."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _NO_AUTOMATIC_FULL)
    log.info("rest process heap settled frozen_objects=%d", gc.get_freeze_count())


class FullCollections(Periodic):
    """A full collection every ``interval_s`` on a daemon thread (what cyclic garbage
    reaches the old generation is freed within that time); ``runs`` counts them."""

    def __init__(self, interval_s: float = FULL_COLLECTION_S) -> None:
        super().__init__(interval_s, self._collect, "rest-full-gc")

    @staticmethod
    def _collect() -> None:
        log.debug("rest process full collection unreachable=%d", gc.collect())


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the controller dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the parent poll below does it


def _exit_with_parent(parent: int, server) -> None:
    while not server.should_exit:
        if os.getppid() != parent:
            log.warning("controller process gone: rest process stopping parent=%d", parent)
            server.should_exit = True
            return
        threading.Event().wait(1.0)


def _place(settings: ControllerSettings) -> None:
    """rest.nice (the decision loop first under contention) and rest.cpus (request
    handling off its CPUs). A sandbox that denies the system call (a systemd
    SystemCallFilter without setpriority or sched_setaffinity) costs the setting, with a
    warning, not the REST API."""
    if settings.rest.nice:
        try:
            os.nice(settings.rest.nice)
        except OSError as exc:
            log.warning("rest.nice not applied error=%s", exc)
    pinned = settings.rest.cpu_set()
    if pinned is not None:
        try:
            pin_process(pinned)
        except OSError as exc:
            log.warning("rest.cpus not applied cpus=%s error=%s", settings.rest.cpus, exc)


def audit_records_kept() -> None:
    """The audit trail (``tpflex.audit``, api/audit_trail.py) is written at INFO: kept
    whatever ``controller.log_level`` says, on the same stream as this process's other
    lines (its stderr, the controller's: journald under systemd). A site routes it
    elsewhere with a handler on that logger (docs/api.md, "Audit log")."""
    audit_log = logging.getLogger("tpflex.audit")
    if audit_log.level == logging.NOTSET or audit_log.level > logging.INFO:
        audit_log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpflex-controller-rest", description="the controller's REST "
                                "process (started by tpflex-controller; settings as JSON on stdin)")
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    ns = p.parse_args(argv)
    _die_with_parent()
    if os.getppid() != ns.parent_pid:  # it died before the line above took effect
        return 1
    settings = ControllerSettings.model_validate(json.loads(sys.stdin.read()))
    logging.basicConfig(level=settings.controller.log_level,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    audit_records_kept()
    _place(settings)
    return _serve(settings, ns.listen_fd, ns.link_fd, ns.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
