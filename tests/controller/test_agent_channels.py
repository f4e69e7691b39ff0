"""The power pusher's channel pool (agent_client.py): at most ``max_channels`` idle
channels to agents, closed after ``channel_idle_s`` unused, and caps still reach a real
agent through the bounded pool."""

from __future__ import annotations

import queue

import pytest
from tpflex_controller.agent_client import AgentPusher
from tpflex_controller.cache import NodePower
from tpflex_controller.settings import ControllerSettings

from tests.controller.controller_harness import eventually
from tests.controller.test_agent_client import _start_agent
from tests.support.ports import free_ports


def _plan(node: str, generation: int) -> NodePower:
    return NodePower(generation, tuple((i, 600.0) for i in range(2)))


def test_channels_are_bounded_and_closed_when_idle():
    results: queue.SimpleQueue = queue.SimpleQueue()
    live_port, *dead_ports = free_ports(7)
    agent = _start_agent("live", "rack0", live_port)
    pusher = AgentPusher(results.put, timeout=1.0, backoff_initial=0.05, backoff_max=0.2,
                         max_channels=2, channel_idle_s=0.5)
    try:
        for i, port in enumerate(dead_ports):  # nobody listens: refused, retried
            pusher.push(f"dead{i}", f"127.0.0.1:{port}", _plan(f"dead{i}", 1))
        pusher.push("live", f"127.0.0.1:{live_port}", _plan("live", 1))
        got = results.get(timeout=15)
        assert (got.node, got.ok, got.generation) == ("live", True, 1)
        # the dead agents' retries go on: channels in use stay, idle ones beyond 2 close
        seen = [pusher.channel_count() for _ in range(50)]
        assert max(seen) <= 2 + 6  # the bound, plus at most one send in flight per agent
        pusher.cancel_all()
        eventually(lambda: pusher.channel_count() <= 2, timeout=10)
        eventually(lambda: pusher.channel_count() == 0, timeout=10)  # idle for 0.5 s: closed
        # a send after the close opens a new channel and still arrives
        pusher.push("live", f"127.0.0.1:{live_port}", _plan("live", 2))
        got = results.get(timeout=15)
        assert (got.node, got.ok, got.generation) == ("live", True, 2)
    finally:
        pusher.close()
        agent.stop(0)
    assert pusher.channel_count() == 0


def test_sends_are_handed_to_the_workers_only_when_one_is_free():
    """30 unreachable agents retried over 2 workers: never more than 2 sends handed over
    (before, every due retry was queued in the executor: thousands of futures at 10,000
    agents, and a new plan's send waited behind them), and a live agent's caps still
    arrive among the retries."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    failures = []
    live_port, *dead_ports = free_ports(31)
    agent = _start_agent("live", "rack0", live_port)
    pusher = AgentPusher(results.put, timeout=1.0, backoff_initial=0.01, backoff_max=0.05, max_workers=2,
                         on_failure=lambda: failures.append(1))
    try:
        for i, port in enumerate(dead_ports):
            pusher.push(f"dead{i}", f"127.0.0.1:{port}", _plan(f"dead{i}", 1))
        seen = []
        while len(failures) < 3 * len(dead_ports):  # every dead agent retried a few times
            seen.append(pusher.sending())
        assert max(seen) <= 2
        pusher.push("live", f"127.0.0.1:{live_port}", _plan("live", 1))
        got = results.get(timeout=15)
        assert (got.node, got.ok) == ("live", True)
    finally:
        pusher.close()
        agent.stop(0)


def test_pool_bounds_are_settings_and_checked():
    s = ControllerSettings.model_validate({"agents": {"max_channels": 64, "channel_idle_s": 5}})
    assert (s.agents.max_channels, s.agents.channel_idle_s) == (64, 5.0)
    with pytest.raises(ValueError):
        ControllerSettings.model_validate({"agents": {"max_channels": 0}})
    pusher = AgentPusher(lambda r: None)
    try:
        with pytest.raises(ValueError):
            pusher.set_channel_bounds(0, 1.0)
    finally:
        pusher.close()


def test_pushes_faster_than_the_workers_send_queue_one_entry_per_node():
    """Plans for 20 nodes, 100 generations each, while the only worker waits on an agent
    that never answers: the send heap holds about one entry per node (it held one per
    push: under the load bench's storm of plans it grew by ~65,000 entries in 2 minutes),
    and each node's newest plan is the one pending."""
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # connections complete in the backlog; nobody answers
    address = f"127.0.0.1:{hole.getsockname()[1]}"
    pusher = AgentPusher(lambda r: None, timeout=5.0, max_workers=1, backoff_initial=5.0, backoff_max=5.0)
    try:
        pusher.push("first", address, _plan("first", 1))
        eventually(lambda: pusher.sending() == 1, timeout=10)  # the worker is stuck there
        for gen in range(1, 101):
            for i in range(20):
                pusher.push(f"n{i}", address, _plan(f"n{i}", gen))
        assert len(pusher._heap) <= 2 * 20
        assert {n: g for n, g in pusher.pending().items() if n != "first"} == {f"n{i}": 100 for i in range(20)}
    finally:
        pusher.close()
        hole.close()


def test_a_channel_that_did_not_reach_its_agent_is_not_kept():
    """Agents nobody listens for, with a pool bound and an idle time that would keep all
    their channels: each failed send closes its channel (before, the 6 stayed for the idle
    time, and under the load bench the pool sat at its bound); a live agent's channel
    stays pooled; an agent that comes back at its address gets the pending plan through a
    channel opened anew."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    failures = []
    live_port, back_port, *dead_ports = free_ports(8)
    agent = _start_agent("live", "rack0", live_port)
    pusher = AgentPusher(results.put, timeout=1.0, backoff_initial=0.05, backoff_max=0.2,
                         max_channels=64, channel_idle_s=3600.0, on_failure=lambda: failures.append(1))
    back = None
    try:
        pusher.push("live", f"127.0.0.1:{live_port}", _plan("live", 1))
        got = results.get(timeout=15)
        assert (got.node, got.ok) == ("live", True)
        assert pusher.channel_count() == 1  # reached: kept for the next plan
        for i, port in enumerate(dead_ports):
            pusher.push(f"dead{i}", f"127.0.0.1:{port}", _plan(f"dead{i}", 1))
        pusher.push("back", f"127.0.0.1:{back_port}", _plan("back", 1))
        eventually(lambda: len(failures) >= 3 * (len(dead_ports) + 1), timeout=20)
        with pusher._cv:  # between two retries a dead agent holds no channel
            assert len(pusher._channels) <= 1 + pusher.sending()  # (the lock is reentrant)
        back = _start_agent("back", "rack0", back_port)
        got = results.get(timeout=15)
        assert (got.node, got.ok, got.generation) == ("back", True, 1)
        pusher.cancel_all()  # no new sends; those in flight end and release their channels
        eventually(lambda: pusher.channel_count() == 2, timeout=10)  # the two agents reached
    finally:
        pusher.close()
        agent.stop(0)
        if back is not None:
            back.stop(0)
