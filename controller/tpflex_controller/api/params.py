"""Path and query parameters of the REST API, checked strictly (422 with the parameter's
name otherwise): names in the characters etcd records use, integers in canonical decimal
(``1.0``, ``+1``, ``01``, `` 1`` and ``１`` are refused as the body refuses ``6.0``)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Path, Query
from pydantic import BeforeValidator

# node and rack names: tpflex_proto.config.valid_name (what agents may register under)
NAME_PATTERN = r"^[A-Za-z0-9._-]{1,63}$"
# job names: RegisterJob's rule (spec_checks.JOB_NAME)
JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_CANONICAL = re.compile(r"(0|[1-9][0-9]{0,8})")


def canonical_int(value: object) -> object:
    """A path or query integer must be written as plain decimal digits."""
    if isinstance(value, str) and not _CANONICAL.fullmatch(value):
        raise ValueError("must be a whole number in plain decimal digits (no sign, point or leading zero)")
    return value


_Int = BeforeValidator(canonical_int)

NodeName = Annotated[str, Path(pattern=NAME_PATTERN, description="node name (1-63 of A-Z a-z 0-9 . _ -)")]
RackName = Annotated[str, Path(pattern=NAME_PATTERN, description="rack name (1-63 of A-Z a-z 0-9 . _ -)")]
JobName = Annotated[str, Path(pattern=JOB_PATTERN, description="job name (1-128 of A-Z a-z 0-9 . _ -)")]
GpuIndex = Annotated[int, _Int, Path(ge=0, le=1_000_000, description="NVML index on the node")]
Limit = Annotated[int, _Int, Query(ge=1, le=1000, description="at most this many (1-1000)")]


# reasons and other operator text: printable, no control characters (no newlines, escapes)
TEXT_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"
