"""``tpflex-controller``: one controller replica.

Every replica serves the trainer gRPC service and the REST API and keeps its view of etcd
warm (one informer: tpflex_proto.informer); the elected leader also plans, commits and
pushes power caps. The REST API runs in a child process this one supervises
(api/process.py): REST load does not share the decision loop's GIL. SIGTERM/SIGINT: resign
the leadership (a standby takes over at once), stop serving, exit 0. Bad configuration or
an address that cannot be bound: a message on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading

from prometheus_client import CollectorRegistry
from tpflex_proto.config import read_text_file
from tpflex_proto.etcd import Etcd, EtcdTls
from tpflex_proto.informer import Informer
from tpflex_proto.keys import Kind
from tpflex_proto.tls import (
    ClientCertificateFiles,
    ServerTls,
    TlsFilesError,
    check_server_files,
)

from tpflex_controller import heap, memtrace
from tpflex_controller.api.process import RestSupervisor
from tpflex_controller.election import Elector
from tpflex_controller.metrics import ControllerMetrics
from tpflex_controller.reconcile import Reconciler
from tpflex_controller.settings import ConfigError, ControllerSettings, load_settings
from tpflex_controller.steps import GoodputCollector, StepStats
from tpflex_controller.trainer_service import create_grpc_server

log = logging.getLogger("tpflex_controller")

_EPILOG = """\
configuration: --config FILE (TOML, see deploy/config/controller.toml) or $TPFLEX_CONTROLLER_CONFIG;
every key can be overridden by TPFLEX_<SECTION>__<KEY> (e.g. TPFLEX_ETCD__ENDPOINTS, lists as
JSON); precedence: argument > environment > file > default. Unknown keys and bad values exit 2.
TLS: [rest] tls_cert_file/tls_key_file (HTTPS), [trainer] tls_cert_file/tls_key_file
(+ client_ca_file: mTLS), [agents] ca_file/cert_file/key_file (mTLS to agents), [etcd]
ca_file/cert_file/key_file and username/password_file. Secrets are read from files only;
--print-config prints file paths, never their contents.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpflex-controller",
        description="tpflex controller replica",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # "--admin-token SECRET" must not match --admin-tokens-file
    )
    p.add_argument("--config", help="TOML configuration file (see deploy/config/controller.toml)")
    p.add_argument("--name", help="identity in leader election (default: host name + pid)")
    p.add_argument("--etcd", help="etcd endpoints HOST:PORT[,HOST:PORT...]")
    p.add_argument("--lease-ttl-s", dest="lease_ttl_s", type=int, help="leader lease TTL (s)")
    p.add_argument("--rest-listen", dest="rest_listen", help="REST HOST:PORT")
    p.add_argument("--trainer-listen", dest="trainer_listen", help="trainer gRPC HOST:PORT")
    p.add_argument("--admin-tokens-file", dest="admin_tokens_file",
                   help="file of admin REST tokens, one per line (tokens are never arguments)")
    p.add_argument("--readonly-tokens-file", dest="readonly_tokens_file",
                   help="file of read-only REST tokens, one per line")
    p.add_argument("--job-credentials", dest="job_credentials", choices=["required", "off"],
                   help="[trainer] job_credentials: trainer-plane calls need their job's credential")
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    return p


def _arg_layers(ns: argparse.Namespace) -> dict[str, dict]:
    return {
        "controller": {"name": ns.name, "log_level": ns.log_level},
        "etcd": {"endpoints": ns.etcd, "lease_ttl_s": ns.lease_ttl_s},
        "rest": {
            "listen": ns.rest_listen,
            "admin_tokens_file": ns.admin_tokens_file,
            "readonly_tokens_file": ns.readonly_tokens_file,
        },
        "trainer": {"listen": ns.trainer_listen, "job_credentials": ns.job_credentials},
    }


def create_etcd(s: ControllerSettings) -> Etcd:
    """The etcd client of ``s``; ValueError naming the setting when a secret or TLS file
    cannot be used."""
    e = s.etcd
    tls = EtcdTls(e.ca_file, e.cert_file or None, e.key_file or None) if e.ca_file else None
    password = read_text_file(e.password_file, "etcd.password_file") if e.password_file else None
    try:
        return Etcd(e.endpoints, timeout=e.dial_timeout_s, user=e.username or None, password=password, tls=tls)
    except TlsFilesError as exc:
        raise ValueError(f"etcd TLS (etcd.ca_file, cert_file, key_file): {exc}") from None


def _agent_credentials(s: ControllerSettings) -> ClientCertificateFiles | None:
    """mTLS towards the agents: trust agents.ca_file, present agents.cert_file (read again
    when a file changes, at the next channel to an agent)."""
    a = s.agents
    if not a.ca_file:
        return None
    try:
        return ClientCertificateFiles(a.ca_file, a.cert_file or None, a.key_file or None)
    except TlsFilesError as exc:
        raise ValueError(f"agents TLS (agents.ca_file, cert_file, key_file): {exc}") from None


def _trainer_tls(s: ControllerSettings) -> ServerTls | None:
    t = s.trainer
    if not t.tls_cert_file:
        return None
    return ServerTls(t.tls_cert_file, t.tls_key_file, t.client_ca_file, frozenset(t.client_names))


def _job_auth(s: ControllerSettings, etcd):
    """The trainer plane's per-job credential check (``[trainer] job_credentials``), with
    the REST admin tokens allowed to register a job and be issued its credential."""
    from tpflex_controller.api import load_tokens
    from tpflex_controller.credentials import Credentials, JobAuth

    if s.trainer.job_credentials == "off":
        log.warning("trainer.job_credentials = off: any caller that reaches the trainer port may "
                    "act on any job (docs/deploy.md, 'Trust model')")
        return None
    if not s.trainer.tls_cert_file:
        log.warning("trainer port without TLS: job credentials cross the network in clear "
                    "(set [trainer] tls_cert_file and tls_key_file)")
    r = s.rest
    tokens = load_tokens(r.admin_tokens_file or None, r.readonly_tokens_file or None)
    return JobAuth(Credentials(etcd), admin_check=lambda token, job: _admin_name(tokens, token, job))


def _admin_name(tokens, token: str, job: str) -> str | None:
    """The name of an admin REST token allowed to act on ``job`` (unlimited, or limited
    with ``jobs=`` naming it), or None."""
    caller = tokens.scope_of(token)
    if caller is None or caller.scope != "admin":
        return None
    if caller.limited and (caller.jobs is None or job not in caller.jobs):
        return None
    return caller.name


def _start_rest(
    s: ControllerSettings, registry: CollectorRegistry, steps: StepStats | None = None
) -> RestSupervisor:
    """Bind the REST socket here (a bad address exits 2 at start) and serve it from a
    supervised child process (api/process.py)."""
    from tpflex_controller.api import load_tokens

    r = s.rest
    # read here too: a bad token file or certificate is a start-up error, not a
    # crash-looping child
    load_tokens(r.admin_tokens_file or None, r.readonly_tokens_file or None, protect_reads=r.protect_reads)
    if r.tls_cert_file:
        try:
            check_server_files(r.tls_cert_file, r.tls_key_file)
        except TlsFilesError as exc:
            raise ValueError(f"REST TLS (rest.tls_cert_file, tls_key_file): {exc}") from None
    family = socket.AF_INET6 if ":" in s.rest.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((s.rest.host, s.rest.port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the REST API to {s.rest.listen}: {exc.strerror}") from None
    sock.listen(2048)  # connections queue from now on, not only once the child serves
    rest = RestSupervisor(s, sock, registry, steps)
    rest.start()
    return rest


class ControllerProcess:
    """Everything one replica runs; ``start()`` binds and starts, ``stop()`` undoes it."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = ControllerMetrics(self.registry)
        self.etcd = create_etcd(settings)
        # the process's one watch of /tpflex/v1/; the handlers registered before it starts
        # (the reconcile loop, the plan feed) fold what they need into state of their own,
        # so it keeps the values of the leader key only (the elector registers later)
        self.informer = Informer(self.etcd, keep=frozenset({Kind.LEADER}))
        self.steps = StepStats(stale_after_s=settings.trainer.step_report_stale_s)
        self.registry.register(GoodputCollector(self.steps))
        c = settings.controller
        self.reconciler = Reconciler(
            self.etcd,
            self.metrics,
            event_log_size=c.event_log_size,
            history_size=c.plan_history_size,
            agent_timeout=settings.agents.rpc_timeout_s,
            agent_credentials=_agent_credentials(settings),
            default_policy=c.default_policy,
            flap_hold_down_s=c.flap_hold_down_s,
            override_coalesce_s=c.override_coalesce_s,
            informer=self.informer,
        )
        self.reconciler.pusher.set_channel_bounds(settings.agents.max_channels,
                                                  settings.agents.channel_idle_s)
        self.grpc_server = None
        self.rest: RestSupervisor | None = None
        self.elector: Elector | None = None

    def start(self) -> None:
        s = self.settings
        self.grpc_server, port = create_grpc_server(
            self.etcd,
            bind=s.trainer.listen,
            max_workers=s.trainer.max_workers,
            steps=self.steps,
            tls=_trainer_tls(s),
            min_step_seconds=s.trainer.min_step_seconds,
            rendezvous=s.rendezvous.limits(),
            liveness=s.liveness.policy(),
            on_liveness=self.metrics.liveness_outcome,
            informer=self.informer,
            job_auth=_job_auth(s, self.etcd),
        )
        self.rest = _start_rest(s, self.registry, self.steps)
        self.grpc_server.start()
        self.reconciler.start()
        self.informer.start()
        self.elector = Elector(
            self.etcd,
            s.controller.name,
            address=f"{s.trainer.host}:{port}",
            ttl=s.etcd.lease_ttl_s,
            on_elected=self.reconciler.on_elected,
            on_deposed=self.reconciler.on_deposed,
            informer=self.informer,
        )
        self.elector.start()
        log.info(
            "controller started id=%s rest_port=%d trainer_port=%d etcd=%s",
            s.controller.name, self.rest.port, port, ",".join(s.etcd.endpoints),
        )

    def stop(self) -> None:
        if self.elector is not None:
            self.elector.stop(resign=True)
        self.reconciler.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=2.0).wait(5)
        if self.rest is not None:
            self.rest.stop()
        self.informer.stop()
        self.etcd.close()
        log.info("controller stopped id=%s", self.settings.controller.name)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        settings = load_settings(_arg_layers(ns), config_file=ns.config)
    except ConfigError as exc:
        print(f"tpflex-controller: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(json.dumps(settings.model_dump(), indent=2))
        return 0
    logging.basicConfig(
        level=settings.controller.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("tpflex.audit").setLevel(logging.INFO)  # whatever log_level says
    # before any thread: at most 2 glibc arenas here and in the REST child (heap.py)
    heap.limit_arenas()
    memtrace.install_if_asked()  # debug only: TPFLEX_DEBUG_MEMTRACE_FRAMES=N (memtrace.py)
    trimmer = heap.HeapTrimmer().start()  # freed C heap back to the system every 30 s
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        proc = ControllerProcess(settings)  # reads the secret and certificate files
    except (OSError, ValueError) as exc:
        print(f"tpflex-controller: {exc}", file=sys.stderr)
        trimmer.stop()
        return 2
    try:
        proc.start()
    except (OSError, ValueError) as exc:  # ConfigError, TokenFileError, bind errors
        print(f"tpflex-controller: {exc}", file=sys.stderr)
        proc.stop()
        trimmer.stop()
        return 2
    # wait in slices: a process-directed SIGTERM may be delivered to another thread (gRPC's,
    # the watches'), and Python runs the handler only when the main thread runs bytecode; an
    # untimed wait then never wakes (seen: a controller still waiting 15 s after SIGTERM,
    # SIGTERM caught and not pending, its main thread in a futex wait)
    while not stop.wait(0.5):
        pass
    log.info("controller stopping id=%s", settings.controller.name)
    proc.stop()
    trimmer.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
