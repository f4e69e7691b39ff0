"""``tpflex-run [options] -- COMMAND [ARGS...]``: the node launcher (docs/launch.md).

Starts one rank per local GPU with the TPFLEX_* environment, restarts a rank that dies
(only that one, bounded per window, with backoff), forwards SIGTERM/SIGINT (SIGTERM to the
ranks, SIGKILL after --grace-period-s), and exits with the ranks' status. Bad arguments
exit 2 with a message naming the argument.

Precedence of every setting: argument > environment (the TPFLEX_* variable named in
--help) > default. The node: --node > Slurm (SLURMD_NODENAME under srun) > Kubernetes
(NODE_NAME from the downward API) > the host name.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tpflex_proto import keys
from tpflex_proto.tls import TlsFilesError, check_client_files

from tpflex_trainer.hooks.config import HooksConfigError, load_spec
from tpflex_trainer.hooks.control import ControlConfig, endpoints_from, read_credential
from tpflex_trainer.hooks.store_client import STORE_SCHEME
from tpflex_trainer.launch.credential import (
    CredentialRefused,
    credential_from_file,
    read_token_file,
    register_for_credential,
    write_private,
)
from tpflex_trainer.launch.devices import (
    MAX_GPUS,
    LocalGpu,
    nvml_uuids,
    parse_gpu_list,
    select_gpus,
)
from tpflex_trainer.launch.env import RankSetting, cuda_device_for
from tpflex_trainer.launch.identity import IdentityError, resolve_node
from tpflex_trainer.launch.policy import RestartPolicy

log = logging.getLogger("tpflex_run")
EXIT_USAGE = 2
_TLS = (("--tls-ca", "TPFLEX_TLS_CA"), ("--tls-cert", "TPFLEX_TLS_CERT"),
        ("--tls-key", "TPFLEX_TLS_KEY"), ("--tls-server-name", "TPFLEX_TLS_SERVER_NAME"))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _nproc(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_GPUS:  # as --gpus (0..MAX_GPUS-1); a typo must not build a huge list
        raise argparse.ArgumentTypeError(f"must be within 1..{MAX_GPUS}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < 1e7:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _gpu_list(text: str) -> list[int]:
    try:
        return parse_gpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _module_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise argparse.ArgumentTypeError(f"not a module name: {bad[0]!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpflex-run", usage="tpflex-run [options] -- COMMAND [ARGS...]",
        description="tpflex node launcher: one per node, starts and restarts the node's ranks",
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    p.add_argument("--controller", help="controller gRPC endpoints HOST:PORT[,...] (TPFLEX_CONTROLLER)")
    p.add_argument("--job-spec", help="the job spec, protobuf JSON (TPFLEX_JOB_SPEC)")
    p.add_argument("--job", help="job name (TPFLEX_JOB; default: the spec's name, which it must match)")
    p.add_argument("--node", help="this node's name as its agent registers it (default: see below)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpus", type=_gpu_list, help="NVML indices of the GPUs to start ranks for: 0,1,2 or 0-3")
    g.add_argument("--nproc-per-node", type=_nproc, help="ranks for GPUs 0..N-1 (simulated GPUs)")
    p.add_argument("--isolate-gpus", action="store_true",
                   help="CUDA_VISIBLE_DEVICES=<the rank's GPU> (it is cuda:0); default: all visible, "
                        "TPFLEX_CUDA_DEVICE names it")
    p.add_argument("--store", help=f"rendezvous store (TPFLEX_STORE; default {STORE_SCHEME}: the controller's)")
    for flag, var in _TLS:
        p.add_argument(flag, help=f"({var})")
    p.add_argument("--job-credential-file",
                   help="the job's credential, issued by the controller (TPFLEX_JOB_CREDENTIAL_FILE)")
    p.add_argument("--register-token-file",
                   help="an admin REST token (best limited to this job): register the job with it "
                        "and be issued a credential for this node (TPFLEX_REGISTER_TOKEN_FILE)")
    p.add_argument("--max-restarts", type=_positive_int, default=3, help="restarts of one rank per window (3)")
    p.add_argument("--restart-window-s", type=_seconds, default=300.0, help="the window (300)")
    p.add_argument("--backoff-s", type=_seconds, default=1.0, help="first restart delay, doubling (1)")
    p.add_argument("--backoff-max-s", type=_seconds, default=30.0, help="longest restart delay (30)")
    p.add_argument("--grace-period-s", type=_seconds, default=30.0,
                   help="after SIGTERM/SIGINT, SIGKILL ranks still running after this long (30)")
    p.add_argument("--beat-timeout-s", type=_seconds, default=10.0,
                   help="kill (and restart) a rank whose heartbeat file is older than this; 0 = off (10)")
    p.add_argument("--preload", type=_module_list, metavar="MODULES",
                   help="import these modules (e.g. torch,transformers) once in a zygote process and fork "
                        "each rank from it (TPFLEX_PRELOAD): starts and restarts skip those imports. Only "
                        "for `python SCRIPT ARGS` or `python -m MODULE ARGS` (other commands: Popen); the "
                        "modules are imported with tpflex-run's environment and must not initialise CUDA "
                        "(docs/launch.md, Preloading)")
    p.add_argument("--log-dir", help="write <node>-rank-<local rank>.log files here (may be shared by "
                                     "nodes; default: inherit stdout/stderr)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


class UsageError(ValueError):
    pass


def _check_endpoints(endpoints: tuple[str, ...], flag: str) -> None:
    for endpoint in endpoints:
        if not keys.hostport_ok(endpoint):
            raise UsageError(f"{flag}: {endpoint!r} is not HOST:PORT with a port in 0..65535")


def _check_tls(tls: dict[str, str]) -> None:
    """The certificate files, read and checked once here: an unusable one (a directory,
    not PEM, a key that does not match) would otherwise fail only in the ranks and the
    launcher's own threads, after the ranks started."""
    ca, cert, key = tls["TPFLEX_TLS_CA"], tls["TPFLEX_TLS_CERT"], tls["TPFLEX_TLS_KEY"]
    for flag, var in _TLS[:3]:
        if tls[var] and not os.access(tls[var], os.R_OK):
            raise UsageError(f"{flag}: cannot read {tls[var]}")
    if bool(cert) != bool(key):
        raise UsageError(f"{'--tls-cert' if cert else '--tls-key'}: --tls-cert and --tls-key go together")
    if cert and not ca:
        raise UsageError("--tls-cert: needs --tls-ca (the controller's CA)")
    if not ca:
        return
    try:
        check_client_files(ca)
    except TlsFilesError as exc:
        raise UsageError(f"--tls-ca: {exc}") from None
    if cert:
        try:
            check_client_files(ca, cert, key)
        except TlsFilesError as exc:
            flag = "--tls-key" if str(exc).startswith("cannot read key") else "--tls-cert"
            raise UsageError(f"{flag}: {exc}") from None


def _log_dir(path: str | None) -> None:
    if not path:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir: cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--log-dir: cannot write to {path}")


def _setting(ns: argparse.Namespace, env: Mapping[str, str]) -> tuple[RankSetting, list[LocalGpu]]:
    controller = endpoints_from(ns.controller or env.get("TPFLEX_CONTROLLER", ""))
    if not controller:
        raise UsageError("--controller: no controller endpoint (pass it or set TPFLEX_CONTROLLER)")
    _check_endpoints(controller, "--controller")
    spec_path = ns.job_spec or env.get("TPFLEX_JOB_SPEC", "")
    if not spec_path:
        raise UsageError("--job-spec: missing (pass it or set TPFLEX_JOB_SPEC)")
    try:
        spec = load_spec(spec_path)
    except HooksConfigError as exc:
        raise UsageError(f"--job-spec: {str(exc).split(': ', 1)[-1]}") from None
    if not keys.job_name_ok(spec.name):
        raise UsageError(f"--job-spec: job name {spec.name!r} must be 1-128 letters, digits, '.', '_' "
                         "or '-', starting with a letter or digit")
    job = ns.job or env.get("TPFLEX_JOB", "") or spec.name
    if job != spec.name:
        raise UsageError(f"--job: {job!r} but the job spec is for {spec.name!r}")
    try:
        node = resolve_node(ns.node, env)
        indices, chosen_by = select_gpus(ns.gpus, ns.nproc_per_node, spec, node.name)
        uuids = nvml_uuids(indices)
    except (IdentityError, ValueError) as exc:
        raise UsageError(str(exc) if str(exc).startswith("--") else f"--node: {exc}") from None
    tls = {var: getattr(ns, flag[2:].replace("-", "_")) or env.get(var, "") for flag, var in _TLS}
    _check_tls(tls)
    gpus = [LocalGpu(i, uuids.get(i, "")) for i in indices]
    if not ns.isolate_gpus:
        for gpu in gpus:
            try:
                cuda_device_for(gpu, env.get("CUDA_VISIBLE_DEVICES"))
            except ValueError as exc:
                raise UsageError(f"--gpus: {exc} (or pass --isolate-gpus)") from None
    store = ns.store or env.get("TPFLEX_STORE", "") or STORE_SCHEME
    _check_endpoints(endpoints_from(store.removeprefix(STORE_SCHEME)), "--store")
    credential = ns.job_credential_file or env.get("TPFLEX_JOB_CREDENTIAL_FILE", "")
    register = ns.register_token_file or env.get("TPFLEX_REGISTER_TOKEN_FILE", "")
    if credential and register:
        raise UsageError("--register-token-file: pass it or --job-credential-file, not both")
    try:
        if credential:
            credential_from_file(credential, "--job-credential-file")
            credential = str(Path(credential).resolve())
        elif register:
            read_token_file(register, "--register-token-file")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _log_dir(ns.log_dir)  # before the "launching" line: nothing is started after a refusal
    log.info("launching node=%s node_source=%s job=%s gpus=%s gpus_from=%s store=%s", node.name,
             node.source, job, ",".join(map(str, indices)), chosen_by.replace(" ", "_"), store)
    return RankSetting(controller=controller, job=job, job_spec=str(Path(spec_path).resolve()),
                       node=node.name, store=store, isolate_gpus=ns.isolate_gpus, tls=tls,
                       credential_file=credential), gpus


def main(argv: list[str] | None = None) -> int:
    from tpflex_trainer.launch.keepalive import StoreKeepAlive
    from tpflex_trainer.launch.report import ControllerEvents
    from tpflex_trainer.launch.supervisor import LogEvents, Supervisor

    own, command = _split(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    ns = parser.parse_args(own)  # exits 2 naming the argument
    logging.basicConfig(level=ns.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if not command:
            raise UsageError("COMMAND: missing the training command after --")
        if shutil.which(command[0]) is None:
            raise UsageError(f"COMMAND: {command[0]!r} is not an executable file or on PATH")
        try:
            preload = ns.preload if ns.preload is not None else _module_list(os.environ.get("TPFLEX_PRELOAD", ""))
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--preload: {exc} (TPFLEX_PRELOAD)") from None
        setting, gpus = _setting(ns, os.environ)
        log_dir = Path(ns.log_dir) if ns.log_dir else None
    except (UsageError, OSError) as exc:
        parser.print_usage(sys.stderr)
        print(f"tpflex-run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    register = ns.register_token_file or os.environ.get("TPFLEX_REGISTER_TOKEN_FILE", "")
    if register:
        try:
            setting = _registered(setting, register)
        except CredentialRefused as exc:
            print(f"tpflex-run: error: registering job {setting.job}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    keepalive = None
    if setting.store.startswith(STORE_SCHEME):
        endpoints = endpoints_from(setting.store[len(STORE_SCHEME):]) or setting.controller
        keepalive = StoreKeepAlive(_control(setting, endpoints)).start()
    policy = RestartPolicy(ns.max_restarts, ns.restart_window_s, ns.backoff_s, ns.backoff_max_s)
    reports = ControllerEvents(_control(setting, setting.controller), setting.node).start()
    beat_dir = Path(tempfile.mkdtemp(prefix="tpflex-run-beats-"))
    try:
        return Supervisor(command, gpus, setting, policy=policy, grace_s=ns.grace_period_s,
                          log_dir=log_dir, events=[LogEvents(setting.node), reports],
                          beat_dir=beat_dir, beat_timeout_s=ns.beat_timeout_s, preload=preload).run()
    finally:
        reports.stop()
        shutil.rmtree(beat_dir, ignore_errors=True)
        if register and setting.credential_file:  # the credential file tpflex-run wrote
            shutil.rmtree(Path(setting.credential_file).parent, ignore_errors=True)
        if keepalive is not None:
            keepalive.stop()


def _registered(s: RankSetting, token_file: str) -> RankSetting:
    """``s`` with the credential issued for this node when tpflex-run registers the job
    with the admin token of ``token_file``."""
    import dataclasses

    token = read_token_file(token_file, "--register-token-file")
    credential = register_for_credential(_control(s, s.controller), load_spec(s.job_spec), token,
                                         f"node-{s.node}"[:64])
    if not credential:
        return s
    path = write_private(credential)
    log.info("job registered; credential issued job=%s credential=node-%s", s.job, s.node)
    return dataclasses.replace(s, credential_file=str(path))


def _control(s: RankSetting, endpoints: tuple[str, ...]) -> ControlConfig:
    return ControlConfig(endpoints=endpoints, job=s.job, rank=0,
                         tls_ca_file=s.tls.get("TPFLEX_TLS_CA") or None,
                         tls_cert_file=s.tls.get("TPFLEX_TLS_CERT") or None,
                         tls_key_file=s.tls.get("TPFLEX_TLS_KEY") or None,
                         tls_server_name=s.tls.get("TPFLEX_TLS_SERVER_NAME") or None,
                         credential=read_credential(s.credential_file) if s.credential_file else None)


if __name__ == "__main__":
    sys.exit(main())
