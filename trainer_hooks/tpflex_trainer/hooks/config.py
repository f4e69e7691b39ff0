"""The hooks' configuration: from the environment a launcher sets, or passed in."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format
from tpflex_proto import types_pb2


class HooksConfigError(ValueError):
    """A missing or malformed TPFLEX_* setting; the message names it."""


@dataclass(frozen=True)
class HooksConfig:
    controller: tuple[str, ...]  # controller gRPC endpoints
    job: str
    node: str  # this rank's placement: node name and NVML GPU index
    gpu: int
    store: str  # tpflex://[HOST:PORT,...] (the controller's store) or HOST:PORT (a TCPStore)
    spec_file: str  # the job spec (protobuf JSON) the launcher wrote
    gpu_uuid: str = ""
    cuda_device: int = -1  # torch.cuda.set_device index (TPFLEX_CUDA_DEVICE); -1 = leave it
    backend: str = ""  # "" = nccl when CUDA is available, else gloo
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # steps; 0 = never
    collective_timeout_s: float = 60.0  # above the controller's reaction bound
    plan_wait_s: float = 30.0  # how long to wait for a plan after a failure / at start
    # liveness: a beat to the controller every beat_interval_s (and to tpflex-run's beat
    # file); a step's collectives stuck longer than watchdog_s (0 = half the collective
    # timeout) abort the process groups and are reported as a hang
    beat_interval_s: float = 1.0
    watchdog_s: float = 0.0
    incarnation: int = 0  # TPFLEX_RESTART_COUNT
    beat_file: str = ""
    # TLS on the plan stream: trust tls_ca_file; tls_cert_file/tls_key_file = this rank's
    # client certificate (mTLS); tls_server_name overrides the name checked in the
    # controller's certificate
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    job_credential: str = ""  # TPFLEX_JOB_CREDENTIAL_FILE's token (tpflex-run writes it)
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def watchdog_after_s(self) -> float:
        """The watchdog's limit: shorter than the collective timeout, always."""
        half = self.collective_timeout_s / 2
        return min(self.watchdog_s, half) if self.watchdog_s > 0 else half

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HooksConfig:
        env = os.environ if env is None else env

        def need(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise HooksConfigError(f"{name} is not set (the launcher sets TPFLEX_* for every rank)")
            return value

        def number(name: str, default: float, kind=float):
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise HooksConfigError(f"{name} must be a number, got {raw!r}") from None
            if value < 0:
                raise HooksConfigError(f"{name} must be >= 0, got {raw!r}")
            return value

        return cls(
            controller=tuple(e.strip() for e in need("TPFLEX_CONTROLLER").split(",") if e.strip()),
            job=need("TPFLEX_JOB"),
            node=need("TPFLEX_NODE"),
            gpu=int(number("TPFLEX_GPU", -1, int)) if env.get("TPFLEX_GPU") else _missing("TPFLEX_GPU"),
            store=need("TPFLEX_STORE"),
            spec_file=need("TPFLEX_JOB_SPEC"),
            gpu_uuid=env.get("TPFLEX_GPU_UUID", ""),
            cuda_device=int(number("TPFLEX_CUDA_DEVICE", -1, int)),
            backend=env.get("TPFLEX_BACKEND", ""),
            checkpoint_dir=env.get("TPFLEX_CHECKPOINT_DIR", ""),
            checkpoint_every=int(number("TPFLEX_CHECKPOINT_EVERY", 0, int)),
            collective_timeout_s=number("TPFLEX_COLLECTIVE_TIMEOUT_S", 60.0),
            plan_wait_s=number("TPFLEX_PLAN_WAIT_S", 30.0),
            beat_interval_s=number("TPFLEX_BEAT_INTERVAL_S", 1.0) or 1.0,
            watchdog_s=number("TPFLEX_WATCHDOG_S", 0.0),
            incarnation=int(number("TPFLEX_RESTART_COUNT", 0, int)),
            beat_file=env.get("TPFLEX_BEAT_FILE", "").strip(),
            job_credential=_credential_from_env(env),
            **_tls_from_env(env),
        )


def _tls_from_env(env: Mapping[str, str]) -> dict[str, str]:
    tls = {
        "tls_ca_file": env.get("TPFLEX_TLS_CA", "").strip(),
        "tls_cert_file": env.get("TPFLEX_TLS_CERT", "").strip(),
        "tls_key_file": env.get("TPFLEX_TLS_KEY", "").strip(),
        "tls_server_name": env.get("TPFLEX_TLS_SERVER_NAME", "").strip(),
    }
    if bool(tls["tls_cert_file"]) != bool(tls["tls_key_file"]):
        raise HooksConfigError("TPFLEX_TLS_CERT and TPFLEX_TLS_KEY go together")
    if tls["tls_cert_file"] and not tls["tls_ca_file"]:
        raise HooksConfigError("TPFLEX_TLS_CERT needs TPFLEX_TLS_CA (the controller's CA)")
    names = {"tls_ca_file": "TPFLEX_TLS_CA", "tls_cert_file": "TPFLEX_TLS_CERT",
             "tls_key_file": "TPFLEX_TLS_KEY"}
    for field_name, var in names.items():
        path = tls[field_name]
        if path and not os.access(path, os.R_OK):
            raise HooksConfigError(f"{var}: cannot read {path}")
    return tls


def _credential_from_env(env: Mapping[str, str]) -> str:
    from tpflex_trainer.hooks.control import read_credential

    path = env.get("TPFLEX_JOB_CREDENTIAL_FILE", "").strip()
    if not path:
        return ""
    try:
        return read_credential(path)
    except OSError as exc:
        raise HooksConfigError(f"TPFLEX_JOB_CREDENTIAL_FILE: cannot read {path}: "
                               f"{exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HooksConfigError(f"TPFLEX_JOB_CREDENTIAL_FILE: {exc}") from None


def _missing(name: str):
    raise HooksConfigError(f"{name} is not set (the launcher sets TPFLEX_* for every rank)")


def load_spec(path: str) -> types_pb2.JobSpec:
    try:
        text = Path(path).read_bytes().decode("utf-8")  # protobuf JSON is UTF-8, whatever the locale
    except OSError as exc:
        raise HooksConfigError(f"TPFLEX_JOB_SPEC: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a ValueError, not an OSError
        raise HooksConfigError(f"TPFLEX_JOB_SPEC: {path} is not a JobSpec: not UTF-8 text "
                               f"(byte {exc.start})") from None
    try:
        return json_format.Parse(text, types_pb2.JobSpec())
    except json_format.ParseError as exc:
        raise HooksConfigError(f"TPFLEX_JOB_SPEC: {path} is not a JobSpec: {exc}") from None


def write_spec(spec: types_pb2.JobSpec, path: str | Path) -> None:
    Path(path).write_text(json_format.MessageToJson(spec), encoding="utf-8")
