"""The node's GPUs this launcher starts ranks for.

Which GPUs: ``--gpus`` (NVML indices, ``0,1,2`` or ``0-3``) > ``--nproc-per-node N``
(indices 0..N-1) > the GPUs of this node that the job spec names. Their UUIDs come from
NVML when a driver is there (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA's order NVML's);
on a machine without one (simulated GPUs) they stay empty.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tpflex_proto import types_pb2

log = logging.getLogger(__name__)

MAX_GPUS = 1024


@dataclass(frozen=True)
class LocalGpu:
    index: int  # NVML index on this node
    uuid: str = ""


def parse_gpu_list(text: str) -> list[int]:
    """``"0,1,2"``, ``"0-3"``, ``"0-3,6"`` -> sorted distinct indices; ValueError says why."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{part!r} is not an index or a range A-B") from None
        if not 0 <= first <= last < MAX_GPUS:
            raise ValueError(f"{part!r} is not within 0..{MAX_GPUS - 1} (low-high)")
        out.update(range(first, last + 1))
    return sorted(out)


def spec_gpus(spec: types_pb2.JobSpec, node: str) -> list[int]:
    """The indices of this node's GPUs that the job spec's stages name."""
    return sorted({g.index for rep in spec.replicas for st in rep.stages for g in st.ranks if g.node == node})


def select_gpus(explicit: Sequence[int] | None, nproc: int | None, spec: types_pb2.JobSpec,
                node: str) -> tuple[list[int], str]:
    """(indices, what chose them). ValueError (naming the argument) for GPUs the job spec
    does not give to this node: their ranks could only fail."""
    in_spec = spec_gpus(spec, node)
    if explicit:
        chosen, source = list(explicit), "--gpus"
    elif nproc:
        if not 1 <= nproc <= MAX_GPUS:  # before building the list: a typo must not eat the memory
            raise ValueError(f"--nproc-per-node: {nproc} is not within 1..{MAX_GPUS}")
        chosen, source = list(range(nproc)), "--nproc-per-node"
    else:
        if not in_spec:
            raise ValueError(f"--gpus: job {spec.name}'s spec names no GPU of node {node} "
                             "(check the node name, or pass --gpus / --nproc-per-node)")
        return in_spec, "job spec"
    unknown = [i for i in chosen if i not in in_spec]
    if unknown:
        raise ValueError(f"{source}: GPU {node}:{unknown[0]} is not a rank of job {spec.name} "
                         f"(the spec gives this node {in_spec or 'no GPU'})")
    return chosen, source


def nvml_uuids(indices: Sequence[int]) -> dict[int, str]:
    """index -> UUID from NVML; {} without a driver. ValueError for an index NVML does not
    have (a wrong --gpus on a GPU node)."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("no NVML on this node; GPU UUIDs unknown error=%s", exc)
        return {}
    try:
        count = pynvml.nvmlDeviceGetCount()
        missing = [i for i in indices if i >= count]
        if missing:
            raise ValueError(f"--gpus: GPU {missing[0]} does not exist on this node (NVML sees {count})")
        return {i: pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices}
    except pynvml.NVMLError as exc:
        log.warning("NVML query failed; GPU UUIDs unknown error=%s", exc)
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
