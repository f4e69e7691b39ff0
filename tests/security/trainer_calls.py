"""Every trainer-plane call (the Trainer and Rendezvous services) on a named job, each one
a well-formed request that the services would act on (a write, where the call writes),
for the per-job credential tests."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tpflex_proto import (
    controller_pb2,
    controller_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    types_pb2,
)

TIMEOUT = 5


def every_call(channel: grpc.Channel, spec: types_pb2.JobSpec, node: str, gpu: int,
               metadata: tuple = ()) -> dict[str, Callable[[], object]]:
    """name -> a callable making that call on ``spec``'s job over ``channel``."""
    job = spec.name
    t = controller_pb2_grpc.TrainerStub(channel)
    r = rendezvous_pb2_grpc.RendezvousStub(channel)
    pb = rendezvous_pb2
    kw = {"timeout": TIMEOUT, "metadata": metadata}

    def watch():
        return next(t.WatchPlan(controller_pb2.WatchPlanRequest(job=job), **kw))

    def beat():
        beats = iter([controller_pb2.Beat(job=job, rank=0, generation=1),
                      controller_pb2.Beat(job=job, rank=0, generation=1, goodbye=True)])
        return t.Heartbeat(beats, **kw)

    return {
        "trainer.RegisterJob": lambda: t.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec), **kw),
        "trainer.WatchPlan": watch,
        "trainer.AckPlan": lambda: t.AckPlan(types_pb2.Ack(job=job, rank=0, generation=1), **kw),
        "trainer.ReportStep": lambda: t.ReportStep(controller_pb2.StepReport(
            job=job, rank=0, replica=0, step=1, generation=1, step_seconds=1.0, samples=1), **kw),
        "trainer.Heartbeat": beat,
        "trainer.ReportRankExit": lambda: t.ReportRankExit(controller_pb2.RankExit(
            job=job, node=node, gpu=gpu, incarnation=0, reason="signal:SIGKILL"), **kw),
        "rendezvous.Set": lambda: r.Set(pb.StoreSetRequest(job=job, key="addr", value=b"evil"), **kw),
        "rendezvous.Get": lambda: r.Get(pb.StoreGetRequest(job=job, key="addr"), **kw),
        "rendezvous.Add": lambda: r.Add(pb.StoreAddRequest(job=job, key="n", delta=1), **kw),
        "rendezvous.Check": lambda: r.Check(pb.StoreKeysRequest(job=job, keys=["addr"]), **kw),
        "rendezvous.Wait": lambda: r.Wait(pb.StoreWaitRequest(job=job, keys=["addr"], wait_ms=1), **kw),
        "rendezvous.CompareSet": lambda: r.CompareSet(pb.StoreCompareSetRequest(
            job=job, key="addr", expected=b"", desired=b"evil"), **kw),
        "rendezvous.DeleteKey": lambda: r.DeleteKey(pb.StoreKeyRequest(job=job, key="addr"), **kw),
        "rendezvous.DeletePrefix": lambda: r.DeletePrefix(pb.StoreKeyRequest(job=job, key=""), **kw),
        "rendezvous.NumKeys": lambda: r.NumKeys(pb.StoreJobRequest(job=job), **kw),
        "rendezvous.KeepAlive": lambda: r.KeepAlive(pb.StoreJobRequest(job=job), **kw),
    }


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The call's status code and details (OK and "" when it succeeded)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)
