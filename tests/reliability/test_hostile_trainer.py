"""Issue 16, defects 4 and 5: the Trainer service checks specs, reports and acks against
their meaning and the cluster. Real etcd, real ``tpflex-agent`` processes, a real
``tpflex-controller`` process; gRPC over real channels, REST over real HTTP.

Before the fix: the same GPU twice in a stage, a second job on GPUs another job held and
``global_batch`` 0 were committed; ``RegisterJob`` with a changed spec silently overwrote
a live job; one report of 2^32-1 samples in 1e-9 s set the achieved rate to 6.4e8/s, a
report for replica 99 counted as a replica, NaN/inf/negative durations were stored, a
stale ack overwrote a newer one, the goodput ratio exceeded 1 and REST and the metric
disagreed."""

from __future__ import annotations

import math

import grpc
import httpx
import pytest
from tpflex_controller import synthetic
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, planstore, types_pb2

from tests.agent.support import wait_until
from tests.reliability.fleet import ADMIN, SIM_TDP_W, Fleet, record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _refused(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=5)
    return info.value.code(), info.value.details()


def _boot(fleet: Fleet, **env) -> tuple[object, controller_pb2_grpc.TrainerStub, grpc.Channel]:
    fleet.start_agents()
    ctl = fleet.start_controller("c1", env=env)
    ctl.wait_http()
    channel = grpc.insecure_channel(fleet.trainer_endpoint(ctl))
    return ctl, controller_pb2_grpc.TrainerStub(channel), channel


def _jobs_written_since(fleet: Fleet, rev: int) -> list[str]:
    """Keys under any job written after ``rev``. The agents and the controller may write
    health, power and events meanwhile (a loaded machine, a lease renewal's health write);
    a refused spec must not have reached any job's records."""
    kvs, _ = fleet.etcd.get_prefix(keys.PREFIX)
    return [kv.key for kv in kvs if kv.mod_revision > rev and kv.key.startswith(keys.PREFIX + "jobs/")]


def _spec(name: str, racks: list[str], **kw) -> types_pb2.JobSpec:
    return synthetic.job(name, racks, 4, **kw)


def test_specs_are_checked_against_their_meaning_and_the_cluster(fleet):
    ctl, stub, channel = _boot(fleet)
    register = stub.RegisterJob
    job1 = _spec("job1", ["rack0", "rack1"])
    register(controller_pb2.RegisterJobRequest(spec=job1), timeout=5)
    fleet.wait_generation(1, timeout=20)
    rev = fleet.etcd.get_prefix(keys.PREFIX)[1]

    twice = _spec("twice", ["rack0"])
    twice.replicas[0].stages[0].ranks.extend(
        types_pb2.GpuRef(node=n, index=i) for n, i in
        [("rack0-n00", 0), ("rack0-n00", 0), ("rack0-n00", 1), ("rack0-n01", 0)])
    code, why = _refused(register, controller_pb2.RegisterJobRequest(spec=twice))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "used twice" in why
    code, why = _refused(register, controller_pb2.RegisterJobRequest(spec=_spec("job2", ["rack1"])))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "belongs to job job1" in why
    zero = _spec("zero", ["rack0"])
    zero.global_batch = 0
    code, why = _refused(register, controller_pb2.RegisterJobRequest(spec=zero))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "global_batch" in why
    smaller = _spec("job1", ["rack0"])  # drops replica 1 of the live job
    code, why = _refused(register, controller_pb2.RegisterJobRequest(spec=smaller))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "PUT /v1/jobs/job1/spec" in why
    assert _jobs_written_since(fleet, rev) == []  # nothing refused was written
    register(controller_pb2.RegisterJobRequest(spec=job1), timeout=5)  # the same spec: accepted
    assert _jobs_written_since(fleet, rev) == []

    body = {"base_tp": 4, "replicas": [{"stages": [{"rack": "rack0"}]}],
            "units": [{"name": u.name, "count": u.count} for u in job1.units],
            "global_batch": job1.local_batch, "local_batch": job1.local_batch}
    url = f"{ctl.rest_url}/v1/jobs/job1/spec"
    assert httpx.put(url, json=body, timeout=10).status_code == 401  # an explicit admin operation
    changed = httpx.put(url, json=body, headers=ADMIN, timeout=10)
    assert changed.status_code == 202 and changed.json()["changed"] is True, changed.text
    plan = fleet.wait_generation(2, timeout=20)
    assert len(plan.replicas) == 1 and plan.cause == "job_spec"
    register(controller_pb2.RegisterJobRequest(spec=_spec("job2", ["rack1"])), timeout=5)  # rack1 is free now

    # job2 boosted by a failure, then deleted: its plan goes and its caps return to TDP
    wait_until(lambda: fleet.etcd.get(keys.job_plan("job2")) is not None, 20, "job2 planned")
    fleet.inject("rack1-n00", 0, "xid79")
    wait_until(lambda: any(c.cap_w > SIM_TDP_W for c in _plan(fleet, "job2").power_caps), 20,
               "job2 boosted")
    wait_until(lambda: max(fleet.applied_caps().values()) > SIM_TDP_W, 20, "boost applied")
    assert httpx.delete(f"{ctl.rest_url}/v1/jobs/job2", timeout=10).status_code == 401
    deleted = httpx.delete(f"{ctl.rest_url}/v1/jobs/job2", headers=ADMIN, timeout=10)
    assert deleted.status_code == 202, deleted.text
    wait_until(lambda: fleet.etcd.get(keys.job_plan("job2")) is None, 20, "job2's plan removed")
    wait_until(lambda: max(fleet.applied_caps().values()) == SIM_TDP_W, 20, "caps back to TDP")
    assert fleet.etcd.get_prefix(keys.job_prefix("job2"))[0] == []
    assert httpx.get(f"{ctl.rest_url}/v1/jobs/job2", timeout=10).status_code == 404
    channel.close()
    record("trainer_specs", "RegisterJob with a GPU twice, a second job on held GPUs, global_batch 0, "
           "a changed spec of a live job; PUT spec and DELETE job over REST",
           "each refused with a status and a message, nothing written; the spec change and the "
           "deletion need the admin token; a deleted job's plan goes and its caps return to TDP", {})


def _plan(fleet: Fleet, job: str) -> types_pb2.Plan:
    return planstore.read_plan(fleet.etcd, job) or types_pb2.Plan()  # header + parts


def _report(**kw) -> controller_pb2.StepReport:
    base = dict(job="job1", rank=0, replica=0, step=1, generation=1, step_seconds=0.1, samples=8,
                tp_degree=4, base_tp=4)
    return controller_pb2.StepReport(**{**base, **kw})


def _goodput(ctl) -> tuple[dict, float | None, float | None]:
    rest = httpx.get(f"{ctl.rest_url}/v1/jobs/job1", timeout=10).json()["goodput"]
    return (rest, ctl.metric('tpflex_job_achieved_samples_per_second{training_job="job1"}'),
            ctl.metric('tpflex_job_goodput_ratio{training_job="job1"}'))


def test_reports_and_acks_that_cannot_be_true_are_refused_and_throughput_expires(fleet):
    ctl, stub, channel = _boot(fleet, TPFLEX_TRAINER__STEP_REPORT_STALE_S="3")
    fleet.put_job()
    fleet.wait_generation(1, timeout=20)
    bad = [
        _report(samples=2**32 - 1, step_seconds=1e-9), _report(samples=2**32 - 1),
        _report(step_seconds=1e-9), _report(replica=99), _report(rank=999),
        _report(step_seconds=math.nan), _report(step_seconds=math.inf), _report(step_seconds=-1.0),
        _report(samples=0), _report(tp_degree=9), _report(base_tp=8), _report(generation=99),
        _report(generation=0),
    ]
    for r in bad:
        code, why = _refused(stub.ReportStep, r)
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (r, code)
        assert why
    for step in range(1, 12):  # two honest replicas, 8 samples per 0.1 s step
        for replica in (0, 1):
            stub.ReportStep(_report(replica=replica, rank=4 * replica, step=step), timeout=5)
    rest, metric, ratio = _goodput(ctl)
    assert rest["replicas_seen"] == 2 and rest["achieved_samples_per_s"] > 0
    assert metric == pytest.approx(rest["achieved_samples_per_s"], rel=1e-9)  # one definition
    assert rest["achieved_samples_per_s"] <= 2 * 8 / 0.1 + 1e-6  # the job's reported-step bound
    assert ratio is not None and 0.0 <= ratio <= 1.0

    fleet.inject("rack1-n00", 0, "xid79")
    fleet.wait_generation(2, timeout=20)
    stub.AckPlan(types_pb2.Ack(job="job1", rank=3, generation=2, reshard_seconds=0.5), timeout=5)
    code, why = _refused(stub.AckPlan, types_pb2.Ack(job="job1", rank=3, generation=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale" in why
    for reshard in (math.nan, math.inf, -1.0):
        code, _ = _refused(stub.AckPlan, types_pb2.Ack(job="job1", rank=3, generation=2, reshard_seconds=reshard))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    stored = codec.decode(types_pb2.Ack, fleet.etcd.get(keys.job_ack("job1", 3)).value)
    assert (stored.generation, stored.reshard_seconds) == (2, 0.5)
    assert all(math.isfinite(x) for x in (stored.acked_at, stored.reshard_seconds))

    # the reports stop: after trainer.step_report_stale_s the achieved rate is 0 again
    wait_until(lambda: _goodput(ctl)[0]["achieved_samples_per_s"] == 0.0, 15, "throughput expired")
    wait_until(lambda: ctl.metric('tpflex_job_achieved_samples_per_second{training_job="job1"}') == 0.0, 5,
               "the metric expired")
    channel.close()
    record("trainer_reports", f"{len(bad)} step reports that cannot be true (2^32-1 samples in 1e-9 s, "
           "replica 99, rank 999, NaN/inf/negative durations, future/zero generation, ...); stale and "
           "NaN acks; reports stop",
           "each refused; replicas_seen stays 2; REST and the metric agree; the ratio is within "
           "[0, 1]; the stored ack keeps the newer generation; the achieved rate expires to 0", {})
