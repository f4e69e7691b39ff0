"""``tpflex-agent``: the node agent process.

Prints one line ``tpflex-agent ready node=... grpc=HOST:PORT metrics=HOST:PORT`` on stdout
when serving, so tests and the demo can find the bound ports. SIGTERM/SIGINT shut down
gracefully: health NOT_SERVING, the etcd lease revoked, the server drained.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from tpflex_proto.tls import TlsFilesError

from .backend import GpuBackend
from .errors import GpuError
from .settings import ConfigError, load_settings

log = logging.getLogger("tpflex_agent")
EXIT_USAGE = 2

_EPILOG = """\
configuration: --config FILE (TOML, see deploy/config/agent.toml) or $TPFLEX_AGENT_CONFIG; every
key can be overridden by TPFLEX_<SECTION>__<KEY> (e.g. TPFLEX_AGENT__RACK, TPFLEX_ETCD__ENDPOINTS);
precedence: argument > environment > file > default. Unknown keys and bad values exit 2.
TLS: [grpc] tls_cert_file/tls_key_file (+ client_ca_file: mTLS, refused clients are logged with
their address; client_names: accepted certificate CNs); plaintext gRPC only with --insecure
(grpc.insecure = true), logged loudly. [metrics] tls_cert_file/tls_key_file
(HTTPS), [etcd] ca_file/cert_file/key_file and username/password_file. Secrets are read from
files only; --print-config prints file paths, never their contents.
"""


# (flag, section, key, type, help)
_FLAGS = (
    ("--backend", "agent", "backend", str, "nvml (GPU nodes) or sim (simulated GPUs)"),
    ("--sim-gpus", "agent", "sim_gpus", int, "number of simulated GPUs"),
    ("--sim-fabric", "agent", "sim_fabric", str, "simulated NVLink fabric <cluster uuid>/<clique id>"),
    ("--rack", "agent", "rack", str, "rack (NVLink domain) of this node (default: from the NVLink fabric)"),
    ("--node", "agent", "node", str, "node name (default: host name)"),
    ("--log-level", "agent", "log_level", str, "DEBUG, INFO, WARNING or ERROR"),
    ("--etcd", "etcd", "endpoints", str, "etcd endpoints HOST:PORT[,HOST:PORT...]"),
    ("--lease-ttl-s", "etcd", "lease_ttl_s", int, "registration lease TTL in seconds"),
    ("--listen", "grpc", "listen", str, "gRPC HOST:PORT (port 0: any free port)"),
    ("--advertise-address", "grpc", "advertise_address", str, "gRPC HOST:PORT the controller dials"),
    ("--metrics-listen", "metrics", "listen", str, "/metrics HOST:PORT"),
    ("--health-debounce-s", "health", "debounce_s", float, "routine health writes at most this often"),
    ("--health-poll-s", "health", "poll_s", float, "GPU polling interval"),
    ("--power-check-s", "power", "check_s", float, "re-read desired caps and check the devices"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpflex-agent", description="tpflex node agent", epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", help="TOML configuration file (deploy/config/agent.toml)")
    for flag, section, key, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=f"{section}.{key}", type=typ, help=help_)
    p.add_argument("--metrics-port", type=int, help="/metrics port on 0.0.0.0 (0: any free port)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="serve gRPC in plaintext (development only: anyone reaching the port may call it)")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    return p


def _cli_layer(ns: dict) -> dict[str, dict]:
    layer: dict[str, dict] = {}
    for dest, value in ns.items():
        if "." in dest and value is not None:
            section, key = dest.split(".", 1)
            layer.setdefault(section, {})[key] = value
    if ns.get("metrics_port") is not None and "listen" not in layer.get("metrics", {}):
        layer.setdefault("metrics", {})["listen"] = f"0.0.0.0:{ns['metrics_port']}"
    if ns.get("insecure"):
        layer.setdefault("grpc", {})["insecure"] = True
    return layer


def _fail(msg: str) -> int:
    print(f"tpflex-agent: error: {msg}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _open_backend(settings) -> GpuBackend:
    if settings.agent.backend == "sim":
        from .sim import SimulatedBackend

        return SimulatedBackend(settings.agent.sim_gpus, node=settings.node,
                                fabric=settings.agent.sim_fabric_info())
    from .nvml import NvmlBackend

    return NvmlBackend()


def main(argv: list[str] | None = None) -> int:
    ns = vars(_parser().parse_args(argv))
    try:
        settings = load_settings(_cli_layer(ns), os.environ, ns["config"])
    except ConfigError as exc:
        return _fail(str(exc))
    if ns["print_config"]:
        print(json.dumps(settings.masked(), indent=2, sort_keys=True))
        return 0
    logging.basicConfig(level=settings.agent.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        backend = _open_backend(settings)
    except GpuError as exc:
        return _fail(str(exc))
    try:
        return _serve(settings, backend)
    finally:
        backend.close()


def _serve(settings, backend: GpuBackend) -> int:
    from .core import AgentCore
    from .desired import PowerAuthority
    from .membership import Membership
    from .metrics import start_metrics_server
    from .service import create_server, enter_shutdown

    core = AgentCore(settings, backend)
    registered = threading.Event()
    etcd = membership = authority = None
    try:  # the etcd client first: its secret and TLS files are checked before anything serves
        etcd = _etcd_client(settings) if settings.etcd.endpoints else None
    except ValueError as exc:
        return _fail(str(exc))
    try:
        server, port = create_server(settings, backend, core=core)
        httpd, metrics_port = start_metrics_server(core, settings.metrics, registered)
    except (OSError, RuntimeError, ValueError) as exc:
        if etcd is not None:
            etcd.close()
        return _fail(str(exc) if isinstance(exc, TlsFilesError) else f"cannot bind: {exc}")
    _warn_transport(settings, port)
    core.start()
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if etcd is not None:
        membership = Membership(etcd, core, agent_address=settings.grpc.advertised(port),
                                metrics_address=settings.metrics.advertised(metrics_port),
                                ttl_s=settings.etcd.lease_ttl_s, registered=registered).start()
        authority = core.authority = PowerAuthority(etcd, core, check_s=settings.power.check_s).start()
    else:
        log.warning("no etcd endpoints configured: running standalone node=%s", settings.node)
    print(f"tpflex-agent ready node={settings.node} backend={backend.kind} "
          f"grpc={settings.grpc.host}:{port} metrics={settings.metrics.host}:{metrics_port}", flush=True)
    # wait in slices: a process-directed SIGTERM may be delivered to another thread (gRPC's,
    # the watches'), and Python runs the handler only when the main thread runs bytecode; an
    # untimed wait then never wakes (seen: a controller still waiting 15 s after SIGTERM,
    # SIGTERM caught and not pending, its main thread in a futex wait)
    while not stop.wait(0.5):
        pass
    log.info("shutting down node=%s", settings.node)
    enter_shutdown(core)
    if authority is not None:
        authority.stop()
    if membership is not None:
        membership.stop(revoke=True)
    server.stop(grace=2.0).wait()
    httpd.shutdown()
    core.stop()
    if etcd is not None:
        etcd.close()
    log.info("stopped node=%s", settings.node)
    return 0


def _warn_transport(settings, port: int) -> None:
    g = settings.grpc
    if g.insecure:
        for _ in range(3):  # loud on purpose: it must not go unnoticed in a journal
            log.warning("INSECURE: gRPC in plaintext on %s:%d (--insecure): anyone who reaches "
                        "this port can call the agent; use TLS with client certificates (mTLS)",
                        g.host, port)
    elif not g.client_ca_file:
        log.warning("gRPC TLS without client certificates on %s:%d: any client may call the agent; "
                    "set grpc.client_ca_file for mTLS", g.host, port)


def _etcd_client(settings):
    from tpflex_proto.config import read_text_file
    from tpflex_proto.etcd import Etcd, EtcdTls

    e = settings.etcd
    password = read_text_file(e.password_file, "etcd.password_file") if e.password_file else None
    tls = EtcdTls(e.ca_file, e.cert_file or None, e.key_file or None) if e.ca_file else None
    try:
        return Etcd(e.endpoints, timeout=e.dial_timeout_s, user=e.username or None,
                    password=password, tls=tls)
    except TlsFilesError as exc:
        raise ValueError(f"etcd TLS (etcd.ca_file, cert_file, key_file): {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
