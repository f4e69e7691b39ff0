"""The controller's one settings object, validated at start-up.

Sections and keys follow ``deploy/config/controller.toml``. Precedence (highest first):
command-line argument > environment ``TPFLEX_<SECTION>__<KEY>`` (e.g.
``TPFLEX_ETCD__ENDPOINTS``; lists as JSON or comma-separated) > TOML file (``--config`` or
``TPFLEX_CONTROLLER_CONFIG``) > default. Unknown keys are refused, naming the key and its
source; bad values raise :class:`ConfigError` with a message (``tpflex-controller`` exits 2).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from tpflex_proto import config

from tpflex_controller import cpus as cpulist

CONFIG_ENV = "TPFLEX_CONTROLLER_CONFIG"
ConfigError = config.ConfigError


class ControllerSection(config.Section):
    name: str = Field(
        "", description="identity in leader election; empty = host name + pid", validate_default=True
    )
    default_policy: Literal["ntp-pw", "ntp", "dp-drop", "spare"] = "ntp-pw"
    log_level: config.LogLevel = "INFO"
    event_log_size: int = Field(1000, ge=10, le=1_000_000)
    plan_history_size: int = Field(100, ge=2, le=100_000)
    flap_hold_down_s: float = Field(
        2.0, ge=0, le=3600,
        description="a recovered GPU is planned again only after this long healthy (doubling per"
        " recent flap, up to 8x; 0 = off; see docs/reliability.md)",
    )

    override_coalesce_s: float = Field(
        0.25, ge=0, le=60,
        description="operator overrides (drain, undrain, pins) of a job are planned once this"
        " long after the last of a burst (at most 8x this after the first; 0 = at once)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v:
            v = f"{socket.gethostname().split('.')[0]}-{os.getpid()}"
        return config.valid_name(v)


class EtcdSection(config.EtcdClientSection):
    endpoints: list[str] = Field(default_factory=lambda: ["127.0.0.1:2379"], min_length=1)
    lease_ttl_s: int = Field(5, ge=1, le=300, description="leader-election lease TTL")


class _Listener(config.Listener):
    @property
    def host(self) -> str:
        """The address to bind (IPv6 without its brackets)."""
        return self.listen.rsplit(":", 1)[0].strip("[]")


class RestSection(_Listener):
    listen: str = "127.0.0.1:8470"
    admin_tokens_file: str = Field("", description="admin bearer tokens, one per line")
    readonly_tokens_file: str = Field("", description="read-only bearer tokens, one per line")
    protect_reads: bool = Field(False, description="GETs under /v1 need a token of either scope")
    max_in_flight: int = Field(
        4, ge=0, description="REST requests served at once (0 = unbounded); the rest wait"
    )
    busy_wait_s: float = Field(
        10.0, gt=0, description="longest wait for a REST slot before 503 busy (Retry-After)"
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, le=1 << 30, description="longer request bodies are refused (413) unread"
    )
    max_concurrent_bodies: int = Field(
        8, ge=1, le=4096, description="request bodies read at once; others wait (then 503 busy)"
    )
    body_timeout_s: float = Field(
        10.0, gt=0, le=600, description="a request body must arrive within this (408 otherwise)"
    )
    read_your_writes_s: float = Field(
        5.0, ge=0, le=600,
        description="a mutating request answers once the REST process's view holds its write"
        " (so that a GET after it reads it), waiting at most this long (0 = do not wait)",
    )
    row_cache_nodes: int = Field(
        20_000, ge=1, le=1_000_000,
        description="nodes whose rendered GPU rows the REST process keeps for the list endpoints"
        " (least recently used out; about 2.5 KB a node of 4 GPUs)",
    )
    response_cache_entries: int = Field(
        1024, ge=0, le=1_000_000,
        description="rendered GET responses the REST process keeps, each valid until what it"
        " renders changes (least recently used out; 0 = off)",
    )
    response_cache_mb: int = Field(
        64, ge=1, le=65_536, description="at most this many MiB of cached response bodies",
    )
    keep_alive_s: float = Field(
        75.0, gt=0, le=3600,
        description="an idle HTTP keep-alive connection is closed after this many seconds"
        " (uvicorn's own default, 5 s, is shorter than a dashboard's poll or a load balancer's"
        " idle timeout, 60 s on common ones: each poll would reconnect, and a balancer could"
        " send a request on a connection the server is closing)",
    )
    nice: int = Field(
        10, ge=0, le=19,
        description="niceness added to the REST process (os.nice): under CPU contention the"
        " decision loop's process is scheduled first (0 = the controller's own priority)",
    )
    cpus: str = Field(
        "", description="CPUs the REST process runs on, as a Linux CPU list ('6-7', '0,2,4-5';"
        " empty = wherever the controller runs): on a controller host with CPUs to spare, keeps"
        " request handling off the CPUs of the decision loop and etcd (the controller process"
        " itself is placed by its unit: systemd CPUAffinity=, taskset)",
    )

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: str) -> str:
        if v.strip():
            cpulist.check_allowed(cpulist.parse_cpu_list(v))
        return v.strip()

    def cpu_set(self) -> frozenset[int] | None:
        """``cpus`` as a set; None when empty (no pinning)."""
        return cpulist.parse_cpu_list(self.cpus) if self.cpus else None

    @model_validator(mode="after")
    def _tokens(self) -> RestSection:
        config.readable(self.admin_tokens_file, "admin_tokens_file")
        config.readable(self.readonly_tokens_file, "readonly_tokens_file")
        return self


class TrainerSection(config.ClientCaListener, _Listener):
    listen: str = "127.0.0.1:8471"
    max_workers: int = Field(64, ge=4, le=4096, description="concurrent RPCs incl. plan streams")
    min_step_seconds: float = Field(
        1e-3, gt=0, le=3600,
        description="shortest step a report may claim: with local_batch samples per replica"
        " per step, the job's physical bound on samples/s",
    )
    step_report_stale_s: float = Field(
        10.0, gt=0, le=3600, description="a replica whose reports stopped this long counts 0"
    )
    job_credentials: Literal["required", "off"] = Field(
        "required",
        description="required: every trainer-plane call carries a credential of the job it names"
        " (docs/deploy.md, 'Trust model'); off: any caller that reaches the port may act on any job",
    )


class LivenessSection(config.Section):
    """Rank liveness (docs/launch.md "On each kind of failure")."""

    beat_timeout_s: float = Field(10.0, gt=0, le=3600,
                                  description="a rank with no heartbeat this long had a soft failure")
    window_s: float = Field(300.0, gt=0, le=86_400, description="soft failures of a GPU are counted within this")
    max_soft_failures: int = Field(3, ge=1, le=1000,
                                   description="this many soft failures of one GPU in the window drain it")

    def policy(self):
        from tpflex_controller.liveness import LivenessPolicy

        return LivenessPolicy(beat_timeout_s=self.beat_timeout_s, window_s=self.window_s,
                              max_soft_failures=self.max_soft_failures,
                              max_recent=max(64, self.max_soft_failures))


class RendezvousSection(config.Section):
    """The jobs' rendezvous store served on the trainer port (docs/launch.md)."""

    ttl_s: int = Field(600, ge=10, le=86_400,
                       description="a job's store vanishes this long after its last write/keep-alive")
    max_entries_per_job: int = Field(200_000, ge=100, le=10_000_000)
    max_value_bytes: int = Field(1 << 20, ge=1024, le=1_400_000,
                                 description="below etcd's request limit (1.5 MiB by default)")
    max_wait_s: float = Field(10.0, gt=0, le=60, description="longest park of one Get/Wait call")
    max_parked: int = Field(16, ge=0, description="Get/Wait calls parked at once (0: never park)")

    def limits(self):
        from tpflex_controller.rendezvous.limits import RendezvousLimits

        return RendezvousLimits(ttl_s=self.ttl_s, max_keys=self.max_entries_per_job,
                                max_value_bytes=self.max_value_bytes, max_wait_s=self.max_wait_s,
                                max_parked=self.max_parked)


class AgentsSection(config.Section):
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    rpc_timeout_s: float = Field(2.0, gt=0, le=60)
    max_channels: int = Field(
        256, ge=1, le=1_000_000,
        description="gRPC channels to agents kept open at once (least recently used closed first)",
    )
    channel_idle_s: float = Field(
        60.0, gt=0, le=86_400, description="a channel to an agent is closed after this long unused",
    )

    @model_validator(mode="after")
    def _files(self) -> AgentsSection:
        for name in ("ca_file", "cert_file", "key_file"):
            config.readable(getattr(self, name), name)
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        return self


class TimeoutsSection(config.Section):
    agent_lease_ttl_s: float = Field(5, gt=0)
    reaction_bound_s: float = Field(15, gt=0)
    trainer_collective_timeout_s: float = Field(600, gt=0)

    @model_validator(mode="after")
    def _order(self) -> TimeoutsSection:
        if not self.agent_lease_ttl_s < self.reaction_bound_s < self.trainer_collective_timeout_s:
            raise ValueError(
                "need agent_lease_ttl_s < reaction_bound_s < trainer_collective_timeout_s, got "
                f"{self.agent_lease_ttl_s} / {self.reaction_bound_s} / {self.trainer_collective_timeout_s}"
            )
        return self


class ControllerSettings(config.Section):
    controller: ControllerSection = Field(default_factory=ControllerSection)
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    rest: RestSection = Field(default_factory=RestSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    rendezvous: RendezvousSection = Field(default_factory=RendezvousSection)
    liveness: LivenessSection = Field(default_factory=LivenessSection)
    agents: AgentsSection = Field(default_factory=AgentsSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)

    @model_validator(mode="after")
    def _within_reaction_bound(self) -> ControllerSettings:
        """A standby takes over within the leader lease TTL + 1 s and a push to an agent
        gives up after rpc_timeout_s: both must fit in the reaction bound."""
        if self.rendezvous.max_parked > self.trainer.max_workers // 2:
            raise ValueError(
                f"need rendezvous.max_parked <= trainer.max_workers / 2 (parked calls hold worker"
                f" threads), got {self.rendezvous.max_parked} > {self.trainer.max_workers // 2}"
            )
        bound = self.timeouts.reaction_bound_s
        if not self.etcd.lease_ttl_s + 1 <= bound:
            raise ValueError(
                f"need etcd.lease_ttl_s + 1 <= timeouts.reaction_bound_s, got {self.etcd.lease_ttl_s} + 1 > {bound}"
            )
        if not self.agents.rpc_timeout_s < bound:
            raise ValueError(
                f"need agents.rpc_timeout_s < timeouts.reaction_bound_s, got {self.agents.rpc_timeout_s} >= {bound}"
            )
        return self


def load_settings(
    args: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ControllerSettings:
    """Settings from (highest first) ``args`` > ``env`` > the TOML file > defaults.

    ``args`` is ``{section: {key: value}}`` with None values left out."""
    env = os.environ if env is None else env
    return config.load_layers(ControllerSettings, args or {}, env, config_file or env.get(CONFIG_ENV))


__all__ = ["ConfigError", "ControllerSettings", "load_settings"]
