"""What the Trainer service and the REST API accept from outside, checked against its
meaning and against the cluster (pure: no I/O, no clock; the callers pass state in).

- ``check_spec``: a job spec that the planner can plan, whose GPUs are distinct and held
  by no other job, with a batch that adds up;
- ``check_report``: a step report that can be true for the job (replica, rank, degree,
  generation, finite durations within bounds, at most the replica's batch);
- ``check_ack``: an ack of a rank of the job for a generation that exists and is not
  older than the rank's stored ack.

Each failure is a :class:`InputError` whose ``kind`` says how the edge maps it
(``invalid`` -> gRPC INVALID_ARGUMENT / HTTP 422, ``conflict`` -> ALREADY_EXISTS / 409,
``stale`` and ``future`` -> FAILED_PRECONDITION / 409, ``unknown`` -> NOT_FOUND / 404).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tpflex_proto import jobspec, keys, types_pb2

from tpflex_controller import convert
from tpflex_controller.planner.model import ClusterState, GpuKey, JobSpec, PlanningError, RackInfo
from tpflex_controller.planner.planner import validate

JOB_NAME = keys.JOB_NAME_PATTERN
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_BASE_TP = 4096
MAX_REPLICAS = 65536
MAX_STAGES = 256
MAX_UNIT_FAMILIES = 64
MAX_UNITS = 1 << 24
MAX_LOCAL_BATCH = 1 << 20
MAX_STEP_SECONDS = 86_400.0  # a step or a reshard longer than a day is not believed
DEFAULT_MIN_STEP_SECONDS = 1e-3  # trainer.min_step_seconds: the job's physical bound


class InputError(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _invalid(message: str) -> InputError:
    return InputError("invalid", message)


job_name_ok = keys.job_name_ok


def check_job_name(name: str) -> None:
    if not job_name_ok(name):
        raise _invalid(f"job name must be 1-128 of A-Z a-z 0-9 . _ - starting with a letter or "
                       f"digit, got {name[:40]!r}")


# ---- job specs ----


def check_spec(
    spec: types_pb2.JobSpec, racks: Mapping[str, types_pb2.Rack], others: Mapping[str, types_pb2.JobSpec],
) -> JobSpec:
    """The planner's view of ``spec``, or :class:`InputError`. ``others``: every other
    registered job (a GPU may belong to one job only)."""
    check_job_name(spec.name)
    _check_fields(spec)
    infos = {name: convert.rack_info(r) for name, r in racks.items()}
    try:
        job = convert.job_spec(spec, infos)
        validate(ClusterState(racks=infos), job)
    except (PlanningError, ValueError) as exc:  # an unknown policy is a ValueError
        raise _invalid(str(exc)) from None
    _check_degree_room(spec, job.min_tp)
    _check_gpus(spec.name, job, infos)
    _check_exclusive(spec.name, claimed(job, infos), others, infos)
    return job


def _check_fields(spec: types_pb2.JobSpec) -> None:
    name = spec.name
    if not 1 <= spec.base_tp <= MAX_BASE_TP:
        raise _invalid(f"job {name}: base_tp must be in 1..{MAX_BASE_TP}, got {spec.base_tp}")
    if not 1 <= len(spec.replicas) <= MAX_REPLICAS:
        raise _invalid(f"job {name}: needs 1..{MAX_REPLICAS} replicas, got {len(spec.replicas)}")
    if any(len(r.stages) > MAX_STAGES for r in spec.replicas):
        raise _invalid(f"job {name}: a replica has more than {MAX_STAGES} stages")
    if not 1 <= spec.local_batch <= MAX_LOCAL_BATCH:
        raise _invalid(f"job {name}: local_batch must be in 1..{MAX_LOCAL_BATCH}, got {spec.local_batch}")
    want = spec.local_batch * len(spec.replicas)
    if spec.global_batch != want:
        raise _invalid(f"job {name}: global_batch must be local_batch x replicas = {want}, "
                       f"got {spec.global_batch}")
    _check_units(spec)
    _check_model(spec)
    if not (math.isfinite(spec.created_at) and spec.created_at >= 0):
        raise _invalid(f"job {name}: created_at must be a finite time, got {spec.created_at!r}")
    if len(set(spec.spare_racks)) != len(spec.spare_racks):
        raise _invalid(f"job {name}: a spare rack is listed twice")
    stage_racks = {st.rack for rep in spec.replicas for st in rep.stages}
    both = sorted(stage_racks & set(spec.spare_racks))
    if both:
        raise _invalid(f"job {name}: rack {both[0]} is both a stage and a spare")


def _check_units(spec: types_pb2.JobSpec) -> None:
    name = spec.name
    if not 1 <= len(spec.units) <= MAX_UNIT_FAMILIES:
        raise _invalid(f"job {name}: needs 1..{MAX_UNIT_FAMILIES} unit families, got {len(spec.units)}")
    seen: set[str] = set()
    for u in spec.units:
        if not UNIT_NAME.fullmatch(u.name):
            raise _invalid(f"job {name}: unit family name {u.name[:40]!r} is not 1-64 of A-Z a-z 0-9 . _ -")
        if u.name in seen:
            raise _invalid(f"job {name}: unit family {u.name} is listed twice")
        seen.add(u.name)
        if not 1 <= u.count <= MAX_UNITS:
            raise _invalid(f"job {name}: unit family {u.name} needs 1..{MAX_UNITS} units, got {u.count}")


MODEL_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHA256 = re.compile(r"[0-9a-f]{64}")


def check_model_units(job: str, model: types_pb2.ModelUnits, what: str) -> None:
    """A ``ModelUnits`` block's own fields (a spec's ``model``, a trainer's at RegisterJob)."""
    if model.model_type and not MODEL_TYPE.fullmatch(model.model_type):
        raise _invalid(f"job {job}: {what}: model_type {model.model_type[:40]!r} is not 1-64 of "
                       "A-Z a-z 0-9 . _ -")
    if model.config_sha256 and not SHA256.fullmatch(model.config_sha256):
        raise _invalid(f"job {job}: {what}: config_sha256 must be 64 lower-case hex digits")
    if not 1 <= model.base_tp <= MAX_BASE_TP:
        raise _invalid(f"job {job}: {what}: base_tp must be in 1..{MAX_BASE_TP}, got {model.base_tp}")
    if not 1 <= len(model.units) <= MAX_UNIT_FAMILIES:
        raise _invalid(f"job {job}: {what}: needs 1..{MAX_UNIT_FAMILIES} unit families, got {len(model.units)}")
    if len({u.name for u in model.units}) != len(model.units):
        raise _invalid(f"job {job}: {what}: a unit family is listed twice")


def _check_model(spec: types_pb2.JobSpec) -> None:
    """A spec that records what its model says (``tpflexctl job-spec``) must agree with it:
    a hand-edited unit count is refused naming the family."""
    if not spec.HasField("model"):
        return
    check_model_units(spec.name, spec.model, "model")
    bad = jobspec.model_contradictions(spec)
    if bad:
        raise _invalid(f"job {spec.name}: the spec's units contradict the model it records "
                       f"({jobspec.describe(spec.model)}): {'; '.join(bad)}")


def trainer_contradictions(spec: types_pb2.JobSpec, model: types_pb2.ModelUnits) -> list[str]:
    """Where the units a registering trainer's adapter derived contradict the job's spec."""
    out = []
    if model.base_tp != spec.base_tp:
        out.append(f"base_tp: spec says {spec.base_tp}, the trainer derived its units at {model.base_tp}")
    return out + jobspec.contradictions(jobspec.unit_counts(spec.units), jobspec.unit_counts(model.units),
                                        source="the trainer's model")


def _check_degree_room(spec: types_pb2.JobSpec, min_tp: int) -> None:
    """A replica's TP degree is at most its smallest unit count (a unit is not split
    across GPUs): with fewer units than ``min_tp`` no replica could ever run, and the
    leader would commit a plan that drops every one (a reconfigure is refused alike)."""
    small = min(spec.units, key=lambda u: u.count)
    if small.count < min_tp:
        raise _invalid(f"job {spec.name}: unit family {small.name} has {small.count} units, fewer than "
                       f"min_tp {min_tp}: the TP degree is at most the smallest unit count, so no "
                       f"replica could run")


def _check_gpus(name: str, job: JobSpec, infos: Mapping[str, RackInfo]) -> None:
    where: dict[GpuKey, str] = {}
    for r_idx, rep in enumerate(job.replicas):
        for s_idx, st in enumerate(rep.stages):
            known = set(infos[st.rack].gpus)
            for g in st.gpus:
                here = f"replica {r_idx} stage {s_idx}"
                if g not in known:
                    raise _invalid(f"job {name}: {here} names GPU {g[0]}:{g[1]}, which is not in rack {st.rack}")
                if g in where:
                    raise _invalid(f"job {name}: GPU {g[0]}:{g[1]} is used twice ({where[g]} and {here})")
                where[g] = here


def claimed(job: JobSpec, infos: Mapping[str, RackInfo]) -> set[GpuKey]:
    """The GPUs a job may plan on: its stages' GPUs and its spare racks' first T GPUs."""
    gpus = {g for rep in job.replicas for st in rep.stages for g in st.gpus}
    for name in job.spare_racks:
        gpus.update(infos[name].gpus[: job.base_tp])
    return gpus


def _check_exclusive(
    name: str, mine: set[GpuKey], others: Mapping[str, types_pb2.JobSpec], infos: Mapping[str, RackInfo]
) -> None:
    for other_name, other in sorted(others.items()):
        if other_name == name:
            continue
        try:
            theirs = claimed(convert.job_spec(other, infos), infos)
        except (PlanningError, ValueError, KeyError):
            continue  # a stored spec that cannot be read claims nothing the planner could plan
        both = sorted(mine & theirs)
        if both:
            g = both[0]
            raise InputError("conflict", f"job {name}: GPU {g[0]}:{g[1]} (and {len(both) - 1} more) "
                             f"belongs to job {other_name}; a GPU serves one job")


def spec_difference(a: types_pb2.JobSpec, b: types_pb2.JobSpec) -> list[str]:
    """The fields in which two specs differ (created_at aside)."""
    return [f.name for f in types_pb2.JobSpec.DESCRIPTOR.fields
            if f.name != "created_at" and getattr(a, f.name) != getattr(b, f.name)]


# ---- step reports and acks ----


@dataclass(frozen=True)
class JobFacts:
    """What a report or ack of a job is checked against."""

    replicas: int
    ranks: int
    base_tp: int
    local_batch: int
    generation: int  # the current plan's; 0 = no plan yet
    full_tp: int = 0  # T: base_tp capped by the smallest unit count (0: base_tp)


def job_facts(spec: types_pb2.JobSpec, generation: int) -> JobFacts:
    ranks = sum(len(st.ranks) or spec.base_tp for rep in spec.replicas for st in rep.stages)
    full = min([spec.base_tp, *(u.count for u in spec.units)])
    return JobFacts(len(spec.replicas), ranks, spec.base_tp, spec.local_batch or 1, generation, full)


def _seconds(what: str, value: float, least: float) -> None:
    if not math.isfinite(value) or not least <= value <= MAX_STEP_SECONDS:
        raise _invalid(f"{what} must be a finite number of seconds in [{least:g}, {MAX_STEP_SECONDS:g}], "
                       f"got {value!r}")


def check_report(r, facts: JobFacts, min_step_seconds: float = DEFAULT_MIN_STEP_SECONDS) -> None:
    """A ``StepReport`` that cannot be true raises :class:`InputError`: the job's physical
    bound is ``local_batch`` samples per replica per step and steps of at least
    ``min_step_seconds``, i.e. ``replicas x local_batch / min_step_seconds`` samples/s."""
    if r.replica >= facts.replicas:
        raise _invalid(f"replica {r.replica} is not in job {r.job} ({facts.replicas} replicas)")
    if r.rank >= facts.ranks:
        raise _invalid(f"rank {r.rank} is not in job {r.job} ({facts.ranks} ranks)")
    _seconds("step_seconds", r.step_seconds, min_step_seconds)
    if not 1 <= r.samples <= facts.local_batch:
        raise _invalid(f"samples must be in 1..{facts.local_batch} (the job's local batch), got {r.samples}")
    if r.base_tp not in (0, facts.base_tp):
        raise _invalid(f"base_tp {r.base_tp} is not job {r.job}'s ({facts.base_tp})")
    if not 0 <= r.tp_degree <= facts.base_tp:
        raise _invalid(f"tp_degree {r.tp_degree} is above job {r.job}'s base TP degree {facts.base_tp}")
    if r.generation > facts.generation:
        raise InputError("future", f"generation {r.generation} is newer than job {r.job}'s current "
                         f"plan ({facts.generation})")
    if r.generation < 1:
        raise InputError("stale", f"generation {r.generation}: a step runs under a committed plan (>= 1)")


def check_ack(ack: types_pb2.Ack, facts: JobFacts, stored_generation: int) -> None:
    """An ``Ack`` of an unknown rank, of a generation that does not exist yet or older
    than the rank's stored ack, or with a reshard time that cannot be, raises."""
    if ack.generation < 1:
        raise _invalid("generation must be >= 1")
    if ack.rank >= facts.ranks:
        raise _invalid(f"rank {ack.rank} is not in job {ack.job} ({facts.ranks} ranks)")
    _seconds("reshard_seconds", ack.reshard_seconds, 0.0)
    if ack.generation > facts.generation:
        raise InputError("future", f"generation {ack.generation} is newer than job {ack.job}'s "
                         f"current plan ({facts.generation})")
    if ack.generation < stored_generation:
        raise InputError("stale", f"rank {ack.rank} already acked generation {stored_generation}; "
                         f"an ack of {ack.generation} is stale")
