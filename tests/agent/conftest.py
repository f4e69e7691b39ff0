"""Agent fixtures: an in-process agent (simulated GPUs) behind a real gRPC server."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest
from tpflex_agent.core import AgentCore
from tpflex_agent.service import create_server
from tpflex_agent.settings import AgentSettings
from tpflex_agent.sim import SimulatedBackend
from tpflex_proto import agent_pb2_grpc


def sim_settings(node: str = "n1", gpus: int = 4, **sections) -> AgentSettings:
    base = {
        "agent": {"node": node, "rack": "r1", "backend": "sim", "sim_gpus": gpus},
        "grpc": {"listen": "127.0.0.1:0", "insecure": True},
        "metrics": {"listen": "127.0.0.1:0"},
        "health": {"debounce_s": 0.2, "poll_s": 0.1},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return AgentSettings(**base)


@dataclass
class RunningAgent:
    settings: AgentSettings
    backend: SimulatedBackend
    core: AgentCore
    server: grpc.Server
    port: int
    channel: grpc.Channel
    stub: agent_pb2_grpc.AgentStub


def start_agent(settings: AgentSettings) -> RunningAgent:
    backend = SimulatedBackend(settings.agent.sim_gpus, node=settings.node,
                               fabric=settings.agent.sim_fabric_info())
    core = AgentCore(settings, backend).start()
    server, port = create_server(settings, backend, core=core)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return RunningAgent(settings, backend, core, server, port, channel, agent_pb2_grpc.AgentStub(channel))


def stop_agent(a: RunningAgent) -> None:
    a.channel.close()
    a.server.stop(0).wait()
    a.core.stop()
    a.backend.close()


@pytest.fixture
def agent():
    a = start_agent(sim_settings())
    try:
        yield a
    finally:
        stop_agent(a)


@contextmanager
def running_agent(node: str, gpus: int):
    """An in-process simulated agent (``start_agent``), stopped on exit."""
    a = start_agent(sim_settings(node=node, gpus=gpus))
    try:
        yield a
    finally:
        stop_agent(a)
