"""Domain errors of the agent, each with a code; mapped to gRPC status once, in service.py.

GPU errors keep the NVML cause as ``__cause__`` (never swallowed): the NVML backend raises
them ``from`` the ``pynvml.NVMLError``.
"""

from __future__ import annotations

from enum import StrEnum


class GpuErrorCode(StrEnum):
    NO_PERMISSION = "NO_PERMISSION"
    NOT_SUPPORTED = "NOT_SUPPORTED"
    GPU_IS_LOST = "GPU_IS_LOST"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    TIMEOUT = "TIMEOUT"
    DRIVER_NOT_LOADED = "DRIVER_NOT_LOADED"
    LIBRARY_NOT_FOUND = "LIBRARY_NOT_FOUND"
    RESET_REQUIRED = "RESET_REQUIRED"
    UNKNOWN = "UNKNOWN"


class GpuError(Exception):
    """A device operation failed. ``index`` is the GPU (None for node-wide failures)."""

    def __init__(self, code: GpuErrorCode, message: str, index: int | None = None) -> None:
        where = f"gpu {index}: " if index is not None else ""
        super().__init__(f"{where}{code.value}: {message}")
        self.code = code
        self.index = index


class BackendUnavailable(GpuError):
    """The backend cannot start at all (no driver, no library)."""


class AgentErrorCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    STALE_GENERATION = "STALE_GENERATION"
    GENERATION_CONFLICT = "GENERATION_CONFLICT"
    NOT_SUPPORTED_BY_BACKEND = "NOT_SUPPORTED_BY_BACKEND"
    NOT_DESIRED = "NOT_DESIRED"  # a pushed plan that is not etcd's desired state
    DESIRED_UNKNOWN = "DESIRED_UNKNOWN"  # etcd unreachable: a push cannot be checked


class AgentError(Exception):
    """A request to the agent was refused before any device was touched."""

    def __init__(self, code: AgentErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
