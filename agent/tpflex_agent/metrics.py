"""Prometheus metrics read at scrape time (a custom Collector), served at ``/metrics``.

Names and their dcgm-exporter equivalents are listed in docs/agent.md.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from tpflex_proto import types_pb2

from .backend import THROTTLE_REASON_NAMES
from .core import AgentCore
from .errors import GpuError
from .settings import MetricsSection

# GPU series carry dcgm-exporter's own label names, so that they join with DCGM_FI_* series
# on ``UUID`` (or ``Hostname`` + ``gpu``) without label_replace (docs/metrics.md)
GPU_LABELS = ("node", "gpu", "UUID", "Hostname")

HEALTH_STATES = {types_pb2.GPU_HEALTHY: "healthy", types_pb2.GPU_DEGRADED: "degraded",
                 types_pb2.GPU_FAILED: "failed"}


class AgentCollector(Collector):
    def __init__(self, core: AgentCore, registered=None) -> None:
        self.core = core
        self._registered = registered  # a threading.Event, or None when standalone
        self.hostname = socket.gethostname()  # what dcgm-exporter on this host reports

    def _gauge(self, name: str, doc: str, labels=GPU_LABELS) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=list(labels))

    def collect(self) -> Iterator:
        devices = self.core.backend.devices()
        g = {
            "draw": self._gauge("tpflex_gpu_power_draw_watts", "Current power draw."),
            "limit": self._gauge("tpflex_gpu_power_limit_watts", "Enforced power limit (cap)."),
            "default": self._gauge("tpflex_gpu_power_default_limit_watts", "Default power limit."),
            "min": self._gauge("tpflex_gpu_power_min_limit_watts", "Lowest settable power limit."),
            "max": self._gauge("tpflex_gpu_power_max_limit_watts", "Highest settable power limit."),
            "clock": self._gauge("tpflex_gpu_sm_clock_hertz", "Current SM clock."),
            "temp": self._gauge("tpflex_gpu_temperature_celsius", "GPU temperature."),
            "reasons": self._gauge("tpflex_gpu_clocks_event_reasons", "NVML clocks-event (throttle) reasons bitmask."),
            "speed": self._gauge("tpflex_gpu_relative_speed_ratio", "Speed relative to a healthy GPU at the same cap."),
        }
        throttle = self._gauge("tpflex_gpu_throttle_active", "1 while a throttle reason is active.",
                               (*GPU_LABELS, "reason"))
        readable = self._gauge("tpflex_gpu_readable", "1 when the last read of the GPU succeeded.")
        for d in devices:
            labels = [self.core.node, str(d.index), d.uuid, self.hostname]
            g["default"].add_metric(labels, d.default_limit_w)
            g["min"].add_metric(labels, d.min_limit_w)
            g["max"].add_metric(labels, d.max_limit_w)
            try:
                r = self.core.backend.read(d.index)
            except GpuError:
                readable.add_metric(labels, 0)
                continue
            readable.add_metric(labels, 1)
            g["draw"].add_metric(labels, r.power_draw_w)
            g["limit"].add_metric(labels, r.power_limit_w)
            g["clock"].add_metric(labels, r.sm_clock_mhz * 1e6)
            g["temp"].add_metric(labels, r.temperature_c)
            g["reasons"].add_metric(labels, r.throttle_reasons)
            g["speed"].add_metric(labels, r.relative_speed)
            for bit, name in THROTTLE_REASON_NAMES.items():
                throttle.add_metric(labels + [name], 1 if r.throttle_reasons & bit else 0)
        yield from g.values()
        yield throttle
        yield readable
        yield from self._health(devices)
        yield from self._node()

    def _health(self, devices) -> Iterator:
        state = self._gauge("tpflex_gpu_health_state", "1 for the GPU's current health state.",
                            (*GPU_LABELS, "state"))
        xids = CounterMetricFamily("tpflex_gpu_xid_errors", "XID events seen since agent start.",
                                   labels=list(GPU_LABELS))
        states = self.core.monitor.gpu_states()
        counts = dict(self.core.monitor.xid_counts)
        for d in devices:
            labels = [self.core.node, str(d.index), d.uuid, self.hostname]
            current = states[d.index].state if d.index in states else None
            for value, name in HEALTH_STATES.items():
                state.add_metric(labels + [name], 1 if current == value else 0)
            xids.add_metric(labels, counts.get(d.index, 0))
        yield state
        yield xids

    def _node(self) -> Iterator:
        gen = GaugeMetricFamily("tpflex_agent_power_plan_generation", "Generation of the last applied power plan.")
        gen.add_metric([], self.core.power.applied_generation)
        yield gen
        yield from self._authority()
        reg = GaugeMetricFamily("tpflex_agent_registered", "1 while the node holds its etcd registration.")
        reg.add_metric([], 1 if self._registered is not None and self._registered.is_set() else 0)
        yield reg


    def _authority(self) -> Iterator:
        """Applied vs desired power: the desired state is etcd's power/<node> (standalone:
        the last plan applied)."""
        authority = self.core.authority
        labels = ["node"]
        node = [self.core.node]
        diverged = GaugeMetricFamily(
            "tpflex_agent_power_divergent_gpus",
            "GPUs whose enforced power limit is away from the desired cap (more than 1 W)", labels=labels)
        if authority is not None:
            diverged.add_metric(node, len(authority.divergent_gpus()))
        else:
            diverged.add_metric(node, len(_standalone_divergent(self.core)))
        yield diverged
        regressions = CounterMetricFamily(
            "tpflex_agent_power_generation_regressions",
            "Desired power plans applied although older than the applied one (etcd went back)",
            labels=labels)
        regressions.add_metric(node, self.core.power.regressions)
        yield regressions
        if authority is None:
            return
        desired = authority.desired
        gen = GaugeMetricFamily("tpflex_agent_desired_power_generation",
                                "Generation of the desired power plan in etcd (0: none)", labels=labels)
        if desired is not None:
            gen.add_metric(node, desired.generation)
        yield gen
        refused = CounterMetricFamily("tpflex_agent_power_pushes_refused",
                                      "Pushed power plans refused as not etcd's desired state", labels=labels)
        refused.add_metric(node, authority.refused_pushes)
        yield refused
        fixed = CounterMetricFamily("tpflex_agent_power_corrections",
                                    "Times power limits had left the desired caps and were re-applied",
                                    labels=labels)
        fixed.add_metric(node, authority.corrections)
        yield fixed


def _standalone_divergent(core: AgentCore) -> list[int]:
    from .plan import divergent

    targets = core.power.applied_targets()
    limits = {}
    for i in targets:
        try:
            limits[i] = core.backend.read(i).power_limit_w
        except GpuError:
            continue
    return divergent(targets, limits)


def start_metrics_server(core: AgentCore, section: MetricsSection, registered=None):
    """Serve /metrics for ``core`` on ``section.listen`` (port 0 = a free port), over HTTPS
    when a certificate is configured; returns (httpd, bound port)."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(core, registered))
    host = section.host.strip("[]")
    httpd, _thread = start_http_server(
        section.port, addr=host, registry=registry,
        certfile=section.tls_cert_file or None, keyfile=section.tls_key_file or None,
    )
    return httpd, httpd.server_address[1]
