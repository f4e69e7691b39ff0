"""Issue 16, defect 1: an operator pin never stops failure handling. Real etcd, real
``tpflex-agent`` processes (simulated GPUs, XID 79 injected through their gRPC), a real
``tpflex-controller`` process, REST over real HTTP and ``tpflexctl``.

On the code before the fix, the XID 79 on a pinned replica made the job unplannable: the
plan kept listing the failed GPU and no generation 2 was ever committed."""

from __future__ import annotations

import httpx
import pytest
from tpflex_cli import main as cli

from tests.agent.support import wait_until
from tests.reliability.fleet import ADMIN, record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _used(plan) -> set[tuple[str, int]]:
    return {(g.node, g.index) for rep in plan.replicas for st in rep.stages for g in st.gpus}


def _pins(plan) -> list[tuple[int, int]]:
    return [(p.replica, p.tp_degree) for p in plan.suspended_pins]


def _reconfigure(ctl, pins: list[tuple[int, int]]) -> httpx.Response:
    body = {"pins": [{"replica": r, "tp_degree": t} for r, t in pins]}
    return httpx.post(f"{ctl.rest_url}/v1/jobs/job1/reconfigure", json=body, headers=ADMIN, timeout=10)


def _events(ctl, kind: str) -> list[dict]:
    got = httpx.get(f"{ctl.rest_url}/v1/events", params={"limit": 100}, timeout=10).json()["events"]
    return [e for e in got if e["kind"] == kind]


def test_failed_or_drained_gpu_leaves_the_plan_whatever_was_pinned(fleet, capsys):
    fleet.start_agents()
    fleet.put_job()
    ctl = fleet.start_controller("c1")
    ctl.wait_http()
    fleet.wait_generation(1, timeout=20)
    assert _reconfigure(ctl, [(1, 4)]).status_code == 202  # holds: 4 usable GPUs

    fleet.inject("rack1-n00", 1, "xid79")  # a GPU of the pinned replica falls off the bus
    plan = fleet.wait_generation(2, timeout=20)
    assert ("rack1-n00", 1) not in _used(plan) and fleet.degrees() == [4, 3]
    assert _pins(plan) == [(1, 4)] and "rack rack1 has 3" in plan.suspended_pins[0].reason
    wait_until(fleet.caps_converged, 20, "agents at the new plan's caps")
    wait_until(lambda: ctl.metric('tpflex_job_suspended_pins{training_job="job1"}') == 1, 10, "the metric")
    assert ctl.metric('tpflex_job_expected_throughput_ratio{training_job="job1"}') == plan.expected_throughput_ratio
    status = httpx.get(f"{ctl.rest_url}/v1/status", timeout=10).json()
    assert status["jobs"][0]["suspended_pins"] == 1
    job = httpx.get(f"{ctl.rest_url}/v1/jobs/job1", timeout=10).json()
    assert job["plan"]["suspended_pins"][0]["replica"] == 1
    wait_until(lambda: _events(ctl, "pin_suspended"), 10, "a pin_suspended event")
    assert cli.main(["--url", ctl.rest_url, "status"]) == 0
    assert "SUSPENDED PINS" in capsys.readouterr().out
    assert cli.main(["--url", ctl.rest_url, "plan", "job1"]) == 0
    assert "SUSPENDED PIN: replica 1 -> TP 4" in capsys.readouterr().out

    # a pin that conflicts with the current state is refused up front
    refused = _reconfigure(ctl, [(1, 4)])
    assert refused.status_code == 422 and "usable GPUs" in refused.json()["error"]["message"]

    # a drain of a GPU of a pinned replica: drained, and out of the plan
    assert _reconfigure(ctl, [(0, 4)]).status_code == 202
    drain = httpx.post(f"{ctl.rest_url}/v1/nodes/rack0-n01/gpus/0/drain", json={"reason": "test"},
                       headers=ADMIN, timeout=10)
    assert drain.status_code == 202 and drain.json()["changed"] is True
    plan = fleet.wait_generation(3, timeout=20)
    assert ("rack0-n01", 0) not in _used(plan) and fleet.degrees() == [3, 3]
    assert _pins(plan) == [(0, 4), (1, 4)]
    wait_until(lambda: ctl.metric('tpflex_job_suspended_pins{training_job="job1"}') == 2, 10, "the metric")

    # repaired: the pin holds again on its own
    fleet.inject("rack1-n00", 1, "recover")
    plan = fleet.wait_generation(4, timeout=20)
    assert fleet.degrees() == [3, 4] and _pins(plan) == [(0, 4)]
    wait_until(lambda: _events(ctl, "pin_resumed"), 10, "a pin_resumed event")
    wait_until(fleet.caps_converged, 20, "agents at the repaired plan's caps")
    record("pin_suspended", "pin replica 1 to TP 4, XID 79 on one of its GPUs; pin replica 0, drain "
           "one of its GPUs; repair the first GPU",
           "each failed or drained GPU leaves the plan at once; the pins are suspended (plan, "
           "/v1/status, metric, pin_suspended event, tpflexctl) and hold again after the repair; a "
           "conflicting pin request is refused with 422", {"generations": fleet.history()})
