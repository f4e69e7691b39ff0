"""bench/abuse.py's accounting counts what hides a failure (issue 35): a transport error
(connection refused, a timeout, gRPC UNAVAILABLE) and a restart of the controller's REST
child are server errors, each fed here from a real socket, channel or process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import grpc
import httpx
import pytest
from tpflex_proto import agent_pb2, agent_pb2_grpc

from bench.abuse import (
    Tally,
    _alive,
    _children,
    classify_grpc,
    classify_rest,
    classify_transport,
    planted,
    rest_child_errors,
)
from tests.controller.controller_harness import ControllerProc
from tests.support.ports import free_ports
from tests.support.wait import wait_until


def _refused_port() -> int:
    [port] = free_ports(1)  # nothing listens there
    return port


def test_connection_refused_and_timeout_on_rest_are_server_errors():
    tally = Tally()
    with pytest.raises(httpx.ConnectError) as refused:
        httpx.get(f"http://127.0.0.1:{_refused_port()}/v1/status", timeout=5)
    outcome, transport = classify_transport(refused.value)
    tally.add("rest_read", outcome, True, transport)
    # a server that accepts the connection and never answers: a read timeout
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(httpx.ReadTimeout) as timed_out:
            httpx.get(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/status", timeout=0.3)
    outcome, transport = classify_transport(timed_out.value)
    tally.add("rest_read", outcome, True, transport)
    assert tally.outcomes["SERVER_ERROR"] == 2 and tally.outcomes["TRANSPORT_ERROR"] == 2
    assert tally.server_errors == ["rest_read:ConnectError", "rest_read:ReadTimeout"]
    # a decodable reply is judged by its status: 503 busy is deliberate, a 500 is not
    assert not classify_rest(503, '{"detail": "busy, retry"}') and classify_rest(503, "etcd unavailable")
    assert classify_rest(500, "") and not classify_rest(413, "too large")


def test_grpc_unavailable_and_deadline_are_server_errors_refusals_are_not():
    with grpc.insecure_channel(f"127.0.0.1:{_refused_port()}") as ch:
        with pytest.raises(grpc.RpcError) as unavailable:
            agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    assert classify_grpc(unavailable.value.code(), unavailable.value.details()) == (True, True)
    assert classify_grpc(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") == (True, True)
    assert classify_grpc(grpc.StatusCode.INTERNAL, "boom") == (True, False)
    assert classify_grpc(grpc.StatusCode.INVALID_ARGUMENT, "step_seconds must be finite") == (False, False)
    assert classify_grpc(grpc.StatusCode.FAILED_PRECONDITION, "") == (True, False)  # a refusal says why
    tally = Tally()
    tally.add("t_report_nan", "UNAVAILABLE", *classify_grpc(grpc.StatusCode.UNAVAILABLE, "x"))
    tally.add("t_report_nan", "INVALID_ARGUMENT", *classify_grpc(grpc.StatusCode.INVALID_ARGUMENT, "x"))
    assert tally.requests == 2 and tally.outcomes["SERVER_ERROR"] == 1 and tally.outcomes["TRANSPORT_ERROR"] == 1


def test_a_changed_or_dead_rest_child_is_counted():
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert rest_child_errors([first.pid], [first.pid], _alive) == (0, 0)
        assert rest_child_errors([first.pid], [first.pid, second.pid], _alive) == (1, 1)  # restarted once
        assert rest_child_errors([first.pid], [second.pid], _alive) == (1, 1)  # /proc's view of the same
        assert rest_child_errors([first.pid], [], _alive) == (1, 0)  # none running at the end
        first.kill()
        first.wait()
        assert not _alive(first.pid)
        assert rest_child_errors([first.pid], [first.pid], _alive) == (1, 0)  # died, not restarted
        with pytest.raises(ValueError, match="no REST child"):
            rest_child_errors([], [second.pid], _alive)
    finally:
        for p in (first, second):
            p.kill()
            p.wait()


def test_a_rest_child_killed_under_a_real_controller_is_a_server_error(etcd_server, tmp_path):
    ctl = ControllerProc(etcd_server.endpoints, "c1", tmp_path)
    try:
        ctl.wait_http()
        logged = wait_until(lambda: ctl.rest_pids() or None, 15, "the REST child logged")
        running = _children(ctl.proc.pid)
        assert running == logged
        assert rest_child_errors(logged, ctl.rest_pids(), _alive) == (0, 0)
        os.kill(running[0], signal.SIGKILL)
        wait_until(lambda: len(ctl.rest_pids()) == 2, 15, "the REST child restarted")
        assert rest_child_errors(logged, ctl.rest_pids(), _alive)[1] == 1
        wait_until(lambda: _children(ctl.proc.pid) not in ([], running), 15, "the new child running")
        assert rest_child_errors(running, _children(ctl.proc.pid), _alive) == (1, 1)
    finally:
        ctl.kill()


def test_plants_are_named_and_an_unknown_one_is_refused():
    assert planted({}) is None and planted({"TPFLEX_BENCH_PLANT": ""}) is None
    assert planted({"TPFLEX_BENCH_PLANT": "kill-rest-child"}) == "kill-rest-child"
    with pytest.raises(ValueError, match="kill-rest-child"):
        planted({"TPFLEX_BENCH_PLANT": "kill-rest"})
