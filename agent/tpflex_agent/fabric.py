"""The node's rack (NVLink domain) from configuration or from the GPUs' NVLink fabric
(pure). Precedence: ``[agent] rack`` when set > the fabric's domain when every GPU that
answers is registered in one (cluster UUID, clique id) > ``rack0``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .backend import FabricInfo

DEFAULT_RACK = "rack0"


@dataclass(frozen=True)
class RackChoice:
    name: str
    source: str  # config / fabric / default
    detail: str  # why (for the log)


def fabric_rack_name(f: FabricInfo) -> str:
    """``nvl-<cluster uuid, 32 hex>-<clique id>``: stable, and a valid rack name."""
    return f"nvl-{f.cluster_uuid.replace('-', '')}-{f.clique_id}"


def fabric_rack(fabrics: Sequence[FabricInfo | None]) -> tuple[str | None, str]:
    """(rack, why) from the fabric of the GPUs that answered (None: no fabric)."""
    if not fabrics:
        return None, "no GPU answered the fabric query"
    if all(f is None for f in fabrics):
        return None, "the GPUs have no NVLink fabric"
    pending = [f for f in fabrics if f is None or not f.registered]
    if pending:
        return None, f"{len(pending)} of {len(fabrics)} GPUs are not registered with the fabric"
    domains = sorted({(f.cluster_uuid, f.clique_id) for f in fabrics if f is not None})
    if len(domains) > 1:
        return None, f"the GPUs are in {len(domains)} NVLink domains: {domains}"
    if domains[0][0].replace("-", "").strip("0") == "":
        return None, "the fabric reports an empty cluster UUID"
    first = next(f for f in fabrics if f is not None)
    return fabric_rack_name(first), f"cluster_uuid={first.cluster_uuid} clique_id={first.clique_id}"


def resolve_rack(configured: str, fabrics: Sequence[FabricInfo | None]) -> RackChoice:
    if configured:
        return RackChoice(configured, "config", "[agent] rack")
    name, why = fabric_rack(fabrics)
    if name is not None:
        return RackChoice(name, "fabric", why)
    return RackChoice(DEFAULT_RACK, "default", why)
