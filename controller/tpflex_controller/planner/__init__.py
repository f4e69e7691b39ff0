"""The planner: pure decision logic, no I/O (see model.py for its types)."""

from tpflex_controller.planner.model import (  # noqa: F401
    ClusterState,
    GpuKey,
    GpuStatus,
    JobOverrides,
    JobSpec,
    PlanningError,
    PlanResult,
    Policy,
    RackInfo,
    ReplicaAssignment,
    ReplicaSpec,
    ReplicaState,
    StageAssignment,
    StageSpec,
)
from tpflex_controller.planner.planner import plan  # noqa: F401
