"""The etcd key layout (DESIGN.md): every key tpflex reads or writes is built here.

Cluster state lives under ``/tpflex/v1/`` (watched as a whole by the controller's
informers). The jobs' rendezvous stores live under ``/tpflex/rendezvous/v1/``, outside
that range, so that their O(ranks²) churn while process groups form never reaches the
decision loop's watch (docs/launch.md).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

PREFIX = "/tpflex/v1/"

NODES = PREFIX + "nodes/"
HEALTH = PREFIX + "health/"
RACKS = PREFIX + "racks/"
JOBS = PREFIX + "jobs/"
OVERRIDES = PREFIX + "overrides/"
GPU_OVERRIDES = OVERRIDES + "gpus/"
JOB_OVERRIDES = OVERRIDES + "jobs/"
POWER = PREFIX + "power/"
HOLDS = PREFIX + "holds/"  # holds/<node>/<index>: the leader's flap damping of a GPU
LEADER = PREFIX + "leader"
EVENTS = PREFIX + "events/"
# rewritten with every job spec write (register, change, delete): a spec write compares its
# mod revision with the one read before the other jobs' specs, so that two jobs cannot
# claim the same GPUs at once
SPEC_GUARD = PREFIX + "spec-guard"
STEPS = PREFIX + "steps/"
RENDEZVOUS = "/tpflex/rendezvous/v1/"
LIVENESS = "/tpflex/liveness/v1/"
CREDENTIALS = "/tpflex/credentials/v1/"

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


HOSTPORT_PATTERN = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


def hostport_ok(value: str) -> bool:
    """HOST:PORT (a name, an IPv4 address or a bracketed IPv6 one) with a port in 0..65535:
    an address a service registers or is told to dial."""
    m = HOSTPORT_PATTERN.match(value)
    return bool(m) and int(m.group(2)) <= 65535


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


def gpu_hold(node_name: str, index: int) -> str:
    return f"{HOLDS}{node_name}/{index}"


def job_override(job: str) -> str:
    return JOB_OVERRIDES + job


def power(node_name: str) -> str:
    return POWER + node_name


def event(seq: int) -> str:
    return f"{EVENTS}{seq:012d}"


class Kind(enum.Enum):
    """What a key under ``/tpflex/v1/`` is (``parse``)."""

    NODE = "node"  # nodes/<name>
    HEALTH = "health"  # health/<node>
    RACK = "rack"  # racks/<name>
    JOB_SPEC = "job_spec"  # jobs/<job>/spec
    JOB_PLAN = "job_plan"  # jobs/<job>/plan (the plan header)
    JOB_HISTORY = "job_history"  # jobs/<job>/history/<generation>
    JOB_ASSIGN = "job_assign"  # jobs/<job>/assign/<generation>/<position>
    JOB_ACK = "job_ack"  # jobs/<job>/acks/<rank>
    GPU_OVERRIDE = "gpu_override"  # overrides/gpus/<node>/<index>
    JOB_OVERRIDE = "job_override"  # overrides/jobs/<job>
    POWER = "power"  # power/<node>
    GPU_HOLD = "gpu_hold"  # holds/<node>/<index>
    EVENT = "event"  # events/<seq>
    LEADER = "leader"
    SPEC_GUARD = "spec_guard"


@dataclass(frozen=True, slots=True)
class Key:
    """A parsed key: its kind and the names and numbers in it (0 / "" where it has none).
    ``name`` is the node, rack or job the key is about."""

    kind: Kind
    name: str = ""
    number: int = 0  # generation, rank, GPU index or event sequence
    position: int = 0  # the replica position of a JOB_ASSIGN key

    @property
    def node(self) -> str | None:
        """The node a node, health, power or GPU-override key is about."""
        return self.name if self.kind in _NODE_KINDS else None


_NODE_KINDS = frozenset({Kind.NODE, Kind.HEALTH, Kind.POWER, Kind.GPU_OVERRIDE, Kind.GPU_HOLD})
_FLAT = ((NODES, Kind.NODE), (HEALTH, Kind.HEALTH), (RACKS, Kind.RACK), (POWER, Kind.POWER),
         (JOB_OVERRIDES, Kind.JOB_OVERRIDE))
_JOB_LEAVES = {"spec": Kind.JOB_SPEC, "plan": Kind.JOB_PLAN}


def parse(key: str) -> Key | None:
    """The meaning of a key built by this module; None for anything else (a malformed or
    foreign key, which readers skip). The one place that takes keys apart."""
    if not key.startswith(PREFIX):
        return None
    if key == LEADER:
        return Key(Kind.LEADER)
    if key == SPEC_GUARD:
        return Key(Kind.SPEC_GUARD)
    for prefix, kind in _FLAT:
        if key.startswith(prefix):
            name = key[len(prefix):]
            return Key(kind, name) if name and "/" not in name else None
    if key.startswith(GPU_OVERRIDES):
        node_name, _, idx = key[len(GPU_OVERRIDES):].rpartition("/")
        return Key(Kind.GPU_OVERRIDE, node_name, int(idx)) if node_name and idx.isdigit() else None
    if key.startswith(HOLDS):
        node_name, _, idx = key[len(HOLDS):].rpartition("/")
        return Key(Kind.GPU_HOLD, node_name, int(idx)) if node_name and idx.isdigit() else None
    if key.startswith(EVENTS):
        seq = key[len(EVENTS):]
        return Key(Kind.EVENT, number=int(seq)) if seq.isdigit() else None
    if key.startswith(JOBS):
        return _parse_job_key(key)
    return None


def _parse_job_key(key: str) -> Key | None:
    job, sep, rest = key[len(JOBS):].partition("/")
    if not sep or not job:
        return None
    if rest in _JOB_LEAVES:
        return Key(_JOB_LEAVES[rest], job)
    head, _, tail = rest.partition("/")
    if head == "history" and tail.isdigit():
        return Key(Kind.JOB_HISTORY, job, int(tail))
    if head == "acks" and tail.isdigit():
        return Key(Kind.JOB_ACK, job, int(tail))
    if head == "assign":
        gen, _, pos = tail.partition("/")
        if gen.isdigit() and pos.isdigit():
            return Key(Kind.JOB_ASSIGN, job, int(gen), int(pos))
    return None


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


def liveness(job: str) -> str:
    """The job's restart epoch and recent soft failures (``types.Liveness``); outside
    ``/tpflex/v1/`` like the rendezvous store: the trainer service owns it."""
    return f"{LIVENESS}{job}"


def job_credentials(job: str) -> str:
    """/tpflex/credentials/v1/<job>/: the job's trainer credentials (JobCredential), kept out
    of the cluster state's prefix (no reader of the cluster view mirrors them)."""
    return f"{CREDENTIALS}{job}/"


def job_credential(job: str, name: str) -> str:
    return f"{CREDENTIALS}{job}/{name}"
