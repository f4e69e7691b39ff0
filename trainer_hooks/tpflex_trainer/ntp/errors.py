"""Typed errors of the NTP runtime. Each carries a stable ``code`` naming the constraint
that failed; every one of them is raised before any collective is started, so a bad
request never leaves a peer waiting in a collective."""

from __future__ import annotations


class NtpError(Exception):
    """Base class: ``code`` is a stable machine-readable name, the message says why."""

    code = "ntp_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ConfigError(NtpError):
    """A model configuration that cannot be built (e.g. hidden not divisible by heads)."""

    code = "invalid_config"


class LayoutError(NtpError):
    """A layout request that cannot be satisfied. Codes: ``no_replicas``, ``degree_zero``,
    ``degree_above_domain``, ``more_ranks_than_units``, ``duplicate_slot``,
    ``slot_out_of_range``, ``duplicate_replica``, ``partner_unit_mismatch``,
    ``unknown_family``, ``bad_local_batch``."""

    code = "invalid_layout"


class PlanError(NtpError):
    """A plan that does not fit the running world (a member missing from the world map,
    a rank mapped twice, a batch of the wrong size)."""

    code = "invalid_plan"


class UnitsUnavailableError(NtpError):
    """Some units are held by no live member and no checkpoint was given to restore them."""

    code = "units_unavailable"

    def __init__(self, missing: dict[str, list[int]]) -> None:
        listed = ", ".join(f"{fam}:{units}" for fam, units in sorted(missing.items()))
        super().__init__(
            f"units held by no live member and no checkpoint given: {listed}",
        )
        self.missing = missing


class CheckpointMismatchError(NtpError):
    """A checkpoint written for a different model configuration."""

    code = "checkpoint_mismatch"

    def __init__(self, field: str, expected: object, found: object) -> None:
        super().__init__(
            f"checkpoint does not match the model config: field {field!r} is {found!r} "
            f"in the checkpoint, {expected!r} in this model"
        )
        self.field = field
        self.expected = expected
        self.found = found


class CheckpointError(NtpError):
    """A checkpoint that is missing, incomplete or unreadable."""

    code = "checkpoint_invalid"


class UnsupportedModelError(NtpError):
    """A model whose tensor-parallel plan the runtime cannot map to units (an unknown plan
    style, a fused projection, a block without exactly one row-parallel output, ...).
    Raised while the adapter is built, before any collective."""

    code = "unsupported_model"
