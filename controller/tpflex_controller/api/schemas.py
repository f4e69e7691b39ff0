"""Request and response models of the REST API (separate from the stored protobufs)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from tpflex_controller.api.params import NAME_PATTERN, TEXT_PATTERN
from tpflex_controller.planner.model import Policy

# ---- errors ----


class ErrorDetail(BaseModel):
    code: str = Field(examples=["not_found"])
    message: str = Field(examples=["job 'llama' not found"])


class ErrorBody(BaseModel):
    error: ErrorDetail


# ---- requests ----


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DrainRequest(_Request):
    reason: str = Field(min_length=1, max_length=500, pattern=TEXT_PATTERN,
                        examples=["flaky NVLink, RMA ticket 123"])


class ReplicaPinRequest(_Request):
    replica: StrictInt = Field(ge=0, le=1_000_000, description="replica index in the job spec")
    tp_degree: StrictInt = Field(ge=0, le=1_000_000, description="TP degree to pin the replica at")


class ReconfigureRequest(_Request):
    pins: list[ReplicaPinRequest] = Field(default_factory=list, max_length=4096)
    policy: Policy | None = Field(default=None, description="switch the job's policy")
    reason: str = Field(default="", max_length=500, pattern=TEXT_PATTERN)
    clear: StrictBool = Field(default=False, description="drop existing pins and policy override first")


class GpuRefModel(_Request):
    node: str = Field(pattern=NAME_PATTERN)
    index: StrictInt = Field(ge=0, le=1_000_000)


class StageSpecRequest(_Request):
    rack: str = Field(pattern=NAME_PATTERN)
    ranks: list[GpuRefModel] = Field(default_factory=list, max_length=4096,
                                     description="TP ranks in order; empty = the rack's first base_tp GPUs")


class ReplicaSpecRequest(_Request):
    stages: list[StageSpecRequest] = Field(min_length=1, max_length=256)


class UnitFamilyRequest(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", examples=["heads"])
    count: StrictInt = Field(ge=1, le=1 << 24)
    bytes_per_unit: StrictInt = Field(default=0, ge=0, le=1 << 50)


class ModelUnitsRequest(_Request):
    """What the model says (``tpflexctl job-spec`` writes it): the spec's units must agree."""

    model_type: str = Field(default="", pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,63})?$", examples=["llama"])
    config_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    base_tp: StrictInt = Field(ge=1, le=4096)
    units: list[UnitFamilyRequest] = Field(min_length=1, max_length=64)


class JobSpecRequest(_Request):
    """A job's spec as the Trainer service's RegisterJob takes it (the name is the path's)."""

    base_tp: StrictInt = Field(ge=1, le=4096)
    replicas: list[ReplicaSpecRequest] = Field(min_length=1, max_length=65536)
    units: list[UnitFamilyRequest] = Field(min_length=1, max_length=64)
    min_tp: StrictInt = Field(default=1, ge=1, le=4096)
    policy: Policy | None = None
    spare_racks: list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(default_factory=list, max_length=4096)
    global_batch: StrictInt = Field(ge=1, le=1 << 40, description="local_batch x replicas")
    local_batch: StrictInt = Field(ge=1, le=1 << 20)
    model: ModelUnitsRequest | None = Field(
        default=None, description="optional: the model's derived units; the spec's units must agree")


class DryRunRequest(_Request):
    fail: list[GpuRefModel] = Field(default_factory=list, max_length=100_000)
    policy: Policy | None = None
    ignore_overrides: StrictBool = Field(default=False, description="plan without the job's pins/policy override")
    pins: list[ReplicaPinRequest] = Field(
        default_factory=list, max_length=4096,
        description="hypothetical pins, merged over the job's stored pins (preview of a reconfigure)")


# ---- cluster views ----


class GpuStateCounts(BaseModel):
    total: int = 0
    healthy: int = 0
    degraded: int = 0
    failed: int = 0
    drained: int = 0


class GpuView(BaseModel):
    node: str
    index: int
    rack: str
    state: str = Field(description="healthy | degraded | failed | drained")
    reason: str = ""
    node_live: bool
    drained: bool = False
    drain_reason: str = ""
    uuid: str = ""
    name: str = ""
    power_limit_w: float = 0.0
    power_draw_w: float = 0.0
    temperature_c: float = 0.0
    relative_speed: float = 1.0
    xids: list[int] = Field(default_factory=list)
    health_updated_at: float = 0.0
    held: bool = Field(False, description="in the leader's flap hold-down: counts as failed")
    held_until: float | None = Field(None, description="when the hold-down ends (unix s); null while the GPU is still failed")
    hold_reason: str = ""


class RackView(BaseModel):
    name: str
    domain_size: int
    power_budget_w: float
    gpu_tdp_w: float
    gpu_min_w: float
    gpu_max_w: float
    gpus_per_node: int
    nodes: list[str]
    gpus: GpuStateCounts


class RackDetail(RackView):
    gpu_list: list[GpuView]


class NodeView(BaseModel):
    name: str
    rack: str
    live: bool = Field(description="registered with a live etcd lease")
    agent_address: str = ""
    backend: str = ""
    registered_at: float = 0.0
    gpus: GpuStateCounts


class NodeDetail(NodeView):
    gpu_list: list[GpuView]


# ---- plans and jobs ----


class GpuRefView(BaseModel):
    node: str
    index: int


class StagePlanView(BaseModel):
    rack: str
    tp_degree: int
    spec_stage: int
    gpus: list[GpuRefView]


class ReplicaPlanView(BaseModel):
    index: int
    state: str
    tp_degree: int
    local_batch: int
    relative_throughput: float
    reason: str
    stages: list[StagePlanView]


class SuspendedPinView(BaseModel):
    replica: int
    tp_degree: int
    reason: str = Field(description="why the pin cannot hold now; the plan ignores it until it can")


class PowerCapView(BaseModel):
    node: str
    index: int
    cap_w: float


class PlanDecision(BaseModel):
    policy: str
    expected_throughput_ratio: float
    reasons: list[str]
    replicas: list[ReplicaPlanView]
    power_caps: list[PowerCapView]
    suspended_pins: list[SuspendedPinView] = Field(
        default_factory=list, description="operator TP pins this plan could not honour")


class PlanView(PlanDecision):
    job: str
    generation: int
    created_at: float
    cause: str
    by: str = Field("", description="the operator (named REST token) whose change caused it; empty when none did")


class PlanSummary(BaseModel):
    generation: int
    policy: str
    expected_throughput_ratio: float
    created_at: float
    cause: str
    by: str = Field("", description="the operator (named REST token) whose change caused it; empty when none did")
    replica_tp_degrees: list[int]
    degraded_replicas: int
    dropped_replicas: int
    suspended_pins: list[SuspendedPinView] = Field(default_factory=list)


class AckView(BaseModel):
    rank: int
    generation: int
    acked_at: float
    reshard_seconds: float


class PinView(BaseModel):
    replica: int
    tp_degree: int


class JobOverrideView(BaseModel):
    job: str
    pins: list[PinView]
    policy: str
    reason: str
    at: float
    by: str = Field("", description="the operator (named REST token) who set it")


class UnitFamilyView(BaseModel):
    name: str
    count: int


class GoodputView(BaseModel):
    achieved_samples_per_s: float
    failure_free_samples_per_s: float | None
    ratio: float | None
    replicas_reporting: int
    replicas_seen: int


class JobView(BaseModel):
    name: str
    base_tp: int
    min_tp: int
    replicas: int
    policy: str
    effective_policy: str
    units: list[UnitFamilyView]
    spare_racks: list[str]
    global_batch: int
    local_batch: int
    plan: PlanSummary | None
    override: JobOverrideView | None
    acks: list[AckView]
    acked_current: int = Field(description="ranks that acked the current plan generation")
    goodput: GoodputView | None = Field(
        default=None, description="achieved vs failure-free throughput from the trainers' step "
        "reports received by this controller replica; null before any report")


class PlanHistory(BaseModel):
    job: str
    plans: list[PlanView]


class PlanChangeView(BaseModel):
    kind: str = Field(description="plan | replica | power_cap")
    field: str = Field(description="policy, expected_throughput_ratio; state, tp_degree, "
                       "local_batch, gpus; cap_w")
    before: str | float | int | list[str] | None = Field(description="null: no plan / rack TDP")
    after: str | float | int | list[str] | None
    replica: int | None = None
    gpu: GpuRefView | None = None


class DryRunResult(BaseModel):
    job: str
    committed: bool = Field(False, description="always false: a dry run writes nothing")
    failed_gpus: list[GpuRefView]
    current_generation: int | None
    current_expected_throughput_ratio: float | None
    plan: PlanDecision
    changes: list[PlanChangeView] = Field(
        default_factory=list, description="what the plan changes against the current one")


# ---- operations ----


class DrainResult(BaseModel):
    node: str
    index: int
    drained: bool
    changed: bool
    reason: str = ""


class SpecChangeResult(BaseModel):
    job: str
    changed: bool = Field(description="false when the stored spec was already this one")
    note: str = "the controller leader re-plans the job asynchronously"


class JobDeleted(BaseModel):
    job: str
    deleted: bool = True
    note: str = "the controller leader removes the plan and restores the caps it set"


class ReconfigureResult(BaseModel):
    override: JobOverrideView | None
    note: str = "the controller leader re-plans the job asynchronously"


# ---- events and status ----


class PhaseView(BaseModel):
    phase: str
    at: float


class EventView(BaseModel):
    seq: int
    at: float
    kind: str
    job: str
    generation: int
    cause: str
    reasons: list[str]
    phases: list[PhaseView]
    by: str = Field("", description="the operator (named REST token) whose change caused it; empty when none did")


class EventList(BaseModel):
    events: list[EventView]


class LeaderView(BaseModel):
    id: str
    address: str
    since: float


class JobStatus(BaseModel):
    name: str
    generation: int | None
    policy: str
    expected_throughput_ratio: float | None
    replica_tp_degrees: list[int]
    suspended_pins: int = Field(0, description="operator TP pins the current plan ignores")


class UnassignedNodeView(BaseModel):
    node: str
    rack: str = Field(description="the rack the node's agent reported")
    reason: str = Field(examples=["no rack record 'rack0'"])


class StatusView(BaseModel):
    leader: LeaderView | None
    etcd_revision: int
    racks: int
    nodes: int
    live_nodes: int
    gpus: GpuStateCounts
    jobs: list[JobStatus]
    unassigned_nodes: list[UnassignedNodeView] = Field(
        default_factory=list, description="registered nodes that no rack record lists: the "
        "planner does not use their GPUs (sorted by node)")


class Health(BaseModel):
    status: str
    detail: str = ""
    leader: str | None = None


# ---- rack inventory (PUT/PATCH/DELETE /v1/racks/{rack}) ----

_Watts = Annotated[float, Field(strict=True, gt=0, le=1e9, allow_inf_nan=False)]
_NodeList = Annotated[list[Annotated[str, Field(pattern=NAME_PATTERN)]], Field(min_length=1, max_length=4096)]


class RackRequest(_Request):
    """A whole rack record (PUT); the name is the path's (``name``, if given, must equal it)."""

    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    domain_size: StrictInt = Field(ge=1, le=1 << 20, description="GPUs in the NVLink domain: nodes x gpus_per_node")
    power_budget_w: _Watts = Field(description="budget for all GPUs of the rack; at least domain_size x gpu_min_w")
    gpu_tdp_w: _Watts = Field(description="nominal per-GPU power (the default cap)")
    gpu_min_w: _Watts
    gpu_max_w: _Watts
    nodes: _NodeList = Field(description="nodes in rack order (GPU order = node order x index)")
    gpus_per_node: StrictInt = Field(ge=1, le=1024)


class RackPatchRequest(_Request):
    """Fields to change on a stored rack record (PATCH); the others stay as stored."""

    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    domain_size: StrictInt | None = Field(default=None, ge=1, le=1 << 20)
    power_budget_w: _Watts | None = None
    gpu_tdp_w: _Watts | None = None
    gpu_min_w: _Watts | None = None
    gpu_max_w: _Watts | None = None
    nodes: _NodeList | None = None
    gpus_per_node: StrictInt | None = Field(default=None, ge=1, le=1024)


class RackRecord(BaseModel):
    name: str
    domain_size: int
    power_budget_w: float
    gpu_tdp_w: float
    gpu_min_w: float
    gpu_max_w: float
    nodes: list[str]
    gpus_per_node: int


class RackFieldChange(BaseModel):
    field: str
    before: float | int | str | list[str] | None = Field(description="null: the rack was absent")
    after: float | int | str | list[str] | None = Field(description="null: the rack is deleted")


class RackJobImpact(BaseModel):
    """A job that uses the rack: its plan is recomputed by the leader after the write;
    ``changes`` is what the planner gives with the new record against the stored one (the
    cluster's current health, the job's overrides)."""

    job: str
    replans: bool = Field(True, description="the leader re-plans the job after this write")
    changes: list[PlanChangeView] = Field(default_factory=list)
    note: str = ""


class RackWriteResult(BaseModel):
    rack: str
    action: str = Field(description="created | changed | unchanged | deleted")
    dry_run: bool = Field(description="true: validated only, nothing was written")
    record: RackRecord | None = Field(description="the record after the write (null: deleted)")
    changes: list[RackFieldChange]
    jobs: list[RackJobImpact] = Field(default_factory=list, description="jobs whose stages or spare racks use the rack")


class NodeGpuInventory(BaseModel):
    index: int
    name: str
    min_limit_w: float
    default_limit_w: float
    max_limit_w: float
    fabric_cluster_uuid: str = ""
    fabric_clique_id: int = 0


class NodeInventory(BaseModel):
    name: str
    rack: str = Field(description="the rack the node's agent reported")
    rack_source: str = Field(description="config | fabric | default: where the agent got the rack name")
    assigned: bool = Field(description="a rack record lists the node")
    gpus: list[NodeGpuInventory]
