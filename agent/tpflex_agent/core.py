"""The agent's in-process parts around one backend: health monitor and power control."""

from __future__ import annotations

import logging

from tpflex_proto import types_pb2

from .backend import FabricInfo, GpuBackend
from .errors import AgentError, AgentErrorCode, GpuError
from .fabric import resolve_rack
from .monitor import HealthMonitor
from .power import PowerControl
from .settings import AgentSettings

log = logging.getLogger(__name__)


class AgentCore:
    def __init__(self, settings: AgentSettings, backend: GpuBackend) -> None:
        self.settings, self.backend = settings, backend
        self.node = settings.node
        self.rack_choice = resolve_rack(settings.rack, self._fabrics())
        self.rack = self.rack_choice.name
        log.info("rack chosen node=%s rack=%s source=%s detail=%s", self.node, self.rack,
                 self.rack_choice.source, self.rack_choice.detail)
        self.monitor = HealthMonitor(
            backend, settings.node, poll_interval_s=settings.health.poll_s,
            debounce_s=settings.health.debounce_s,
        )
        self.power = PowerControl(backend, settings.node)
        self.grpc_health = None  # set by service.create_server
        self.authority = None  # desired.PowerAuthority when etcd is configured
        self._started = False

    def start(self) -> AgentCore:
        if not self._started:
            self.monitor.start()
            self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self.monitor.stop()
            self._started = False

    @property
    def fault_injection(self) -> bool:
        return hasattr(self.backend, "inject_fault")

    def _fabrics(self) -> list[FabricInfo | None]:
        """The fabric of every GPU that answers (a lost GPU is left out)."""
        out = []
        for d in self.backend.devices():
            try:
                out.append(self.backend.fabric(d.index))
            except GpuError as exc:
                log.warning("fabric query failed node=%s gpu=%d error=%s", self.node, d.index, exc)
        return out

    def devices(self) -> list[types_pb2.GpuDevice]:
        out = []
        for d in self.backend.devices():
            try:
                limit = self.backend.read(d.index).power_limit_w
            except GpuError:
                limit = 0.0
            dev = types_pb2.GpuDevice(
                index=d.index, uuid=d.uuid, name=d.name, serial=d.serial, power_limit_w=limit,
                default_limit_w=d.default_limit_w, min_limit_w=d.min_limit_w,
                max_limit_w=d.max_limit_w, max_sm_clock_mhz=d.max_sm_clock_mhz,
            )
            try:
                fabric = self.backend.fabric(d.index)
            except GpuError:
                fabric = None  # unknown now (lost GPU): leave FABRIC_STATE_UNSPECIFIED
            else:
                dev.fabric_state = types_pb2.FABRIC_NOT_SUPPORTED
            if fabric is not None:
                dev.fabric_cluster_uuid, dev.fabric_clique_id = fabric.cluster_uuid, fabric.clique_id
                dev.fabric_state = int(fabric.state) + 1
            out.append(dev)
        return out

    def inject_fault(self, index: int, kind: str, slow_factor: float) -> types_pb2.NodeHealth:
        if not self.fault_injection:
            raise AgentError(
                AgentErrorCode.NOT_SUPPORTED_BY_BACKEND,
                f"fault injection is only available on the simulated backend (this node runs "
                f"{self.backend.kind})",
            )
        indices = [d.index for d in self.backend.devices()]
        if index not in indices:
            raise AgentError(AgentErrorCode.INVALID_ARGUMENT,
                             f"unknown GPU index {index} (node {self.node} has {len(indices)} GPUs)")
        emitted = self.backend.inject_fault(index, kind, slow_factor)  # type: ignore[attr-defined]
        log.warning("fault injected node=%s gpu=%d kind=%s", self.node, index, kind)
        return self.monitor.settle(emitted)
