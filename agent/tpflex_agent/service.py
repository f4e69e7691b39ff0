"""The agent gRPC service (``tpflex.v1.Agent``) and the standard ``grpc.health.v1``.

Domain errors are mapped to gRPC status codes here, once.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tpflex_proto import agent_pb2, agent_pb2_grpc, types_pb2
from tpflex_proto.tls import ServerTls, TlsFilesError, bind_grpc, server_interceptors

from .backend import GpuBackend
from .core import AgentCore
from .errors import AgentError, AgentErrorCode
from .plan import CapRequest
from .power import ApplyResult
from .settings import AgentSettings

log = logging.getLogger(__name__)

SERVICE_NAME = "tpflex.v1.Agent"
_STATUS = {
    AgentErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    AgentErrorCode.STALE_GENERATION: grpc.StatusCode.FAILED_PRECONDITION,
    AgentErrorCode.GENERATION_CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    AgentErrorCode.NOT_SUPPORTED_BY_BACKEND: grpc.StatusCode.PERMISSION_DENIED,
    AgentErrorCode.NOT_DESIRED: grpc.StatusCode.FAILED_PRECONDITION,
    AgentErrorCode.DESIRED_UNKNOWN: grpc.StatusCode.UNAVAILABLE,
}
_OUTCOME = {
    "APPLIED": agent_pb2.ApplyPowerPlanResponse.APPLIED,
    "ALREADY_APPLIED": agent_pb2.ApplyPowerPlanResponse.ALREADY_APPLIED,
    "PARTIAL": agent_pb2.ApplyPowerPlanResponse.PARTIAL,
}


def _abort(context: grpc.ServicerContext, exc: AgentError, rpc: str):
    log.info("request refused rpc=%s code=%s reason=%s", rpc, exc.code.value, exc.message)
    context.abort(_STATUS[exc.code], exc.message)


def _response(result: ApplyResult) -> agent_pb2.ApplyPowerPlanResponse:
    resp = agent_pb2.ApplyPowerPlanResponse(generation=result.generation, outcome=_OUTCOME[result.outcome])
    for g in result.gpus:
        resp.gpus.add(index=g.index, ok=g.ok, applied_cap_w=g.applied_cap_w,
                      locked_sm_clock_mhz=g.locked_sm_clock_mhz, error=g.error)
    return resp


class AgentServicer(agent_pb2_grpc.AgentServicer):
    def __init__(self, core: AgentCore) -> None:
        self.core = core

    def GetDevices(self, request, context):
        return agent_pb2.GetDevicesResponse(
            node=self.core.node, rack=self.core.rack, backend=self.core.backend.kind,
            gpus=self.core.devices(), health=self.core.monitor.snapshot(),
        )

    def _apply(self, generation: int, caps: list[CapRequest], source: str):
        """With etcd (an authority), only etcd's desired state is applied; standalone, the
        plan generations order the pushes."""
        if generation < 1:  # before anything else, with or without an authority
            raise AgentError(AgentErrorCode.INVALID_ARGUMENT, "generation must be >= 1")
        authority = self.core.authority
        if authority is not None:
            return authority.on_push(generation, caps)
        return self.core.power.apply(generation, caps, source=source)

    def ApplyPowerPlan(self, request, context):
        caps = [CapRequest(c.gpu.node, c.gpu.index, c.cap_w, c.locked_sm_clock_mhz) for c in request.caps]
        try:
            return _response(self._apply(request.generation, caps, "grpc"))
        except AgentError as exc:
            _abort(context, exc, "ApplyPowerPlan")

    def ResetToDefaults(self, request, context):
        try:
            return _response(self._apply(request.generation, [], "reset"))
        except AgentError as exc:
            _abort(context, exc, "ResetToDefaults")

    def WatchHealth(self, request, context):
        current = self.core.monitor.snapshot()
        yield current
        seq = current.seq
        while context.is_active():
            nxt = self.core.monitor.wait_for_seq(seq, timeout_s=1.0)
            if nxt is not None:
                seq = nxt.seq
                yield nxt

    def InjectFault(self, request, context):
        try:
            h = self.core.inject_fault(request.index, request.kind, request.slow_factor)
        except AgentError as exc:
            _abort(context, exc, "InjectFault")
        return agent_pb2.InjectFaultResponse(health=h)


def create_server(
    settings: AgentSettings, backend: GpuBackend, *, core: AgentCore | None = None,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """Build (not start) the gRPC server bound to ``settings.listen``; returns it and the
    bound port (with ``grpc.client_ca_file``: gRPC's mutual TLS, and the allowed client
    names checked per call). Without ``core`` a new :class:`AgentCore` over ``backend`` is
    started."""
    tls = _server_tls(settings)
    if core is None:
        core = AgentCore(settings, backend).start()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="agent-grpc"),
        interceptors=server_interceptors(tls, service="agent"),
    )
    agent_pb2_grpc.add_AgentServicer_to_server(AgentServicer(core), server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    core.grpc_health = health_servicer
    try:
        return bind_grpc(server, settings.grpc.listen, tls, service="agent")
    except TlsFilesError as exc:
        raise TlsFilesError(f"gRPC TLS (grpc.tls_cert_file, tls_key_file, client_ca_file): {exc}") from None
    except OSError as exc:
        raise OSError(f"cannot bind gRPC listen address {settings.grpc.listen}: {exc}") from None


def _server_tls(settings: AgentSettings) -> ServerTls | None:
    """Plaintext, TLS, or mutual TLS (tpflex_proto.tls)."""
    g = settings.grpc
    if not g.tls_cert_file:
        return None
    return ServerTls(g.tls_cert_file, g.tls_key_file, g.client_ca_file, frozenset(g.client_names))


def enter_shutdown(core: AgentCore) -> None:
    if core.grpc_health is not None:
        core.grpc_health.enter_graceful_shutdown()


__all__ = ["AgentServicer", "create_server", "enter_shutdown", "SERVICE_NAME", "types_pb2"]
