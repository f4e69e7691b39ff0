"""tpflex-run's job credential (docs/launch.md, "Job credentials").

Either the operator hands tpflex-run the job's credential (``--job-credential-file``), or
an admin token (``--register-token-file``: a REST admin token, best one limited to this
job with ``jobs=<job>``) with which tpflex-run registers the job itself and is issued a
credential named ``node-<node>`` (issuing it again on a restart replaces the previous
secret of that node). Either way tpflex-run writes the credential to a file only its user
can read and hands its ranks ``TPFLEX_JOB_CREDENTIAL_FILE``; the token never appears in a
command line or an environment variable.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import grpc
from tpflex_proto import controller_pb2, controller_pb2_grpc, types_pb2

from tpflex_trainer.hooks.control import ControlConfig, open_channel, read_credential

log = logging.getLogger(__name__)

PERMANENT = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
             grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
             grpc.StatusCode.FAILED_PRECONDITION}


class CredentialRefused(ValueError):
    """The controller refused to register the job or issue its credential (the message
    says why); retrying cannot help."""


def register_for_credential(config: ControlConfig, spec: types_pb2.JobSpec, admin_token: str,
                            name: str, *, timeout_s: float = 60.0) -> str:
    """Register ``spec`` with an admin token and return the job credential issued for
    ``name`` ("" when the controller checks none); retries unreachable endpoints up to
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    request = controller_pb2.RegisterJobRequest(spec=spec, credential_name=name)
    metadata = (("authorization", f"Bearer {admin_token}"),)
    last = "no controller endpoint answered"
    while True:
        for endpoint in config.endpoints:
            channel = open_channel(_without_credential(config), endpoint)
            try:
                resp = controller_pb2_grpc.TrainerStub(channel).RegisterJob(
                    request, timeout=min(10.0, max(1.0, deadline - time.monotonic())),
                    metadata=metadata)
            except grpc.RpcError as exc:
                if exc.code() in PERMANENT:
                    raise CredentialRefused(f"{exc.code().name}: {exc.details()}") from None
                last = f"{endpoint}: {exc.code().name}: {exc.details()}"
                continue
            finally:
                channel.close()
            if not resp.credential:  # [trainer] job_credentials = off: the ranks need none
                log.warning("the controller registered job %s and issued no credential (its "
                            "[trainer] job_credentials is off)", spec.name)
            return resp.credential
        if time.monotonic() >= deadline:
            raise CredentialRefused(f"could not register the job within {timeout_s:g} s ({last})")
        time.sleep(1.0)


def _without_credential(config: ControlConfig) -> ControlConfig:
    from dataclasses import replace

    return replace(config, credential=None)


def write_private(token: str) -> Path:
    """The token in a new file only this user can read (in a new private directory)."""
    folder = Path(tempfile.mkdtemp(prefix="tpflex-run-credential-"))
    os.chmod(folder, 0o700)
    path = folder / "job.credential"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return path


def read_token_file(path: str, flag: str) -> str:
    """The one token a token file holds (one line; ``#`` comments ignored)."""
    try:
        lines = [ln.split("#", 1)[0].strip() for ln in Path(path).read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{flag}: cannot read {path}: {reason}") from None
    lines = [ln for ln in lines if ln]
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise ValueError(f"{flag}: {path} must hold exactly one token (one line, no spaces)")
    return lines[0]


def credential_from_file(path: str, flag: str) -> str:
    try:
        return read_credential(path)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
