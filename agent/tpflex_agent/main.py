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

from .backend import GpuBackend
from .errors import GpuError
from .settings import ConfigError, load_settings

log = logging.getLogger("tpflex_agent")
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpflex-agent", description="tpflex node agent",
                                argument_default=None)
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--backend", choices=["nvml", "sim"])
    p.add_argument("--sim-gpus", dest="sim_gpus", type=int)
    p.add_argument("--rack")
    p.add_argument("--node")
    p.add_argument("--etcd", help="etcd endpoints HOST:PORT[,HOST:PORT...]")
    p.add_argument("--etcd-timeout-s", dest="etcd_timeout_s", type=float)
    p.add_argument("--listen", help="gRPC HOST:PORT (port 0: any free port)")
    p.add_argument("--advertise-host", dest="advertise_host")
    p.add_argument("--metrics-host", dest="metrics_host")
    p.add_argument("--metrics-port", dest="metrics_port", type=int)
    p.add_argument("--lease-ttl-s", dest="lease_ttl_s", type=int)
    p.add_argument("--health-poll-s", dest="health_poll_s", type=float)
    p.add_argument("--health-debounce-s", dest="health_debounce_s", type=float)
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    return p


def _fail(msg: str) -> int:
    print(f"tpflex-agent: error: {msg}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _open_backend(settings) -> GpuBackend:
    if settings.backend == "sim":
        from .sim import SimulatedBackend

        return SimulatedBackend(settings.sim_gpus, node=settings.node)
    from .nvml import NvmlBackend

    return NvmlBackend()


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    config, print_config = args.pop("config"), args.pop("print_config")
    try:
        settings = load_settings(args, os.environ, config)
    except ConfigError as exc:
        return _fail(str(exc))
    if print_config:
        print(json.dumps(settings.model_dump(), indent=2, sort_keys=True))
        return 0
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
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
    from .membership import DesiredPowerFollower, Membership
    from .metrics import start_metrics_server
    from .service import create_server, enter_shutdown

    core = AgentCore(settings, backend)
    try:
        server, port = create_server(settings, backend, core=core)
        httpd, metrics_port = start_metrics_server(core, settings.metrics_host, settings.metrics_port)
    except (OSError, RuntimeError) as exc:
        return _fail(f"cannot bind: {exc}")
    core.start()
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    etcd = membership = follower = None
    if settings.etcd:
        from tpflex_proto.etcd import Etcd

        etcd = Etcd(settings.etcd, timeout=settings.etcd_timeout_s)
        metrics_addr = f"{settings.advertised(metrics_port).rsplit(':', 1)[0]}:{metrics_port}"
        membership = Membership(etcd, core, agent_address=settings.advertised(port),
                                metrics_address=metrics_addr, ttl_s=settings.lease_ttl_s).start()
        follower = DesiredPowerFollower(etcd, core).start()
    else:
        log.warning("no etcd endpoints configured: running standalone node=%s", settings.node)
    print(f"tpflex-agent ready node={settings.node} backend={backend.kind} "
          f"grpc={settings.listen_host}:{port} metrics={settings.metrics_host}:{metrics_port}", flush=True)
    stop.wait()
    log.info("shutting down node=%s", settings.node)
    enter_shutdown(core)
    if follower is not None:
        follower.stop()
    if membership is not None:
        membership.stop(revoke=True)
    server.stop(grace=2.0).wait()
    httpd.shutdown()
    core.stop()
    if etcd is not None:
        etcd.close()
    log.info("stopped node=%s", settings.node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
