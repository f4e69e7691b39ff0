"""The etcd key layout (DESIGN.md): every key tpflex reads or writes is built here.

Cluster state lives under ``/tpflex/v1/`` (watched as a whole by the controller's
informers). The jobs' rendezvous stores live under ``/tpflex/rendezvous/v1/``, outside
that range, so that their O(ranks²) churn while process groups form never reaches the
decision loop's watch (docs/launch.md).
"""

from __future__ import annotations

import re

PREFIX = "/tpflex/v1/"

NODES = PREFIX + "nodes/"
HEALTH = PREFIX + "health/"
RACKS = PREFIX + "racks/"
JOBS = PREFIX + "jobs/"
OVERRIDES = PREFIX + "overrides/"
GPU_OVERRIDES = OVERRIDES + "gpus/"
JOB_OVERRIDES = OVERRIDES + "jobs/"
POWER = PREFIX + "power/"
LEADER = PREFIX + "leader"
EVENTS = PREFIX + "events/"
# rewritten with every job spec write (register, change, delete): a spec write compares its
# mod revision with the one read before the other jobs' specs, so that two jobs cannot
# claim the same GPUs at once
SPEC_GUARD = PREFIX + "spec-guard"
STEPS = PREFIX + "steps/"
RENDEZVOUS = "/tpflex/rendezvous/v1/"

# node, rack and controller names (one etcd key segment each)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def name_ok(value: str) -> bool:
    """1-63 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    return bool(NAME_PATTERN.match(value))


def node(name: str) -> str:
    return NODES + name


def health(node_name: str) -> str:
    return HEALTH + node_name


def rack(name: str) -> str:
    return RACKS + name


JOB_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def job_name_ok(name: str) -> bool:
    """A job name that is safe as one etcd key segment (and in URLs and label values):
    1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit."""
    return bool(JOB_NAME_PATTERN.fullmatch(name))


def job_prefix(job: str) -> str:
    return f"{JOBS}{job}/"


def job_spec(job: str) -> str:
    return f"{JOBS}{job}/spec"


def job_plan(job: str) -> str:
    return f"{JOBS}{job}/plan"


def job_plan_history(job: str, generation: int) -> str:
    # zero-padded so that a prefix read returns generations in order
    return f"{JOBS}{job}/history/{generation:012d}"


def job_plan_histories(job: str) -> str:
    """Every kept generation's plan header (``history/<generation>``)."""
    return f"{JOBS}{job}/history/"


def job_assigns(job: str) -> str:
    """The replica parts of the job's plans (tpflex_proto.planstore); sorts before
    ``plan`` so that a prefix read hands out a generation's parts before its header."""
    return f"{JOBS}{job}/assign/"


def job_assigns_of(job: str, generation: int) -> str:
    return f"{JOBS}{job}/assign/{generation:012d}/"


def job_assign(job: str, generation: int, position: int) -> str:
    """The replica at ``position`` of the job's plan as generation ``generation`` wrote it."""
    return f"{JOBS}{job}/assign/{generation:012d}/{position:06d}"


def job_acks(job: str) -> str:
    return f"{JOBS}{job}/acks/"


def job_ack(job: str, rank: int) -> str:
    return f"{JOBS}{job}/acks/{rank}"


def gpu_override(node_name: str, index: int) -> str:
    return f"{GPU_OVERRIDES}{node_name}/{index}"


def job_override(job: str) -> str:
    return JOB_OVERRIDES + job


def power(node_name: str) -> str:
    return POWER + node_name


def event(seq: int) -> str:
    return f"{EVENTS}{seq:012d}"


def split_job_key(key: str) -> tuple[str, str] | None:
    """``/tpflex/v1/jobs/<job>/<rest>`` -> (job, rest); None for other keys."""
    if not key.startswith(JOBS):
        return None
    job, sep, rest = key[len(JOBS):].partition("/")
    return (job, rest) if sep and job else None


def rendezvous_prefix(job: str) -> str:
    """Everything of one job's rendezvous store (removed with its lease)."""
    return f"{RENDEZVOUS}{job}/"


def rendezvous_lease(job: str) -> str:
    """The job's rendezvous lease id (decimal), itself bound to that lease."""
    return f"{RENDEZVOUS}{job}/lease"


def rendezvous_keys(job: str) -> str:
    return f"{RENDEZVOUS}{job}/kv/"


def rendezvous_key(job: str, key: str) -> str:
    """One c10d store key of the job (any UTF-8 text; '/' only nests)."""
    return f"{RENDEZVOUS}{job}/kv/{key}"
