"""The jobs' rendezvous store: c10d Store semantics over etcd, served over gRPC by every
controller replica (``Rendezvous`` of rendezvous.proto; docs/launch.md)."""

from tpflex_controller.rendezvous.limits import (
    RendezvousLimits,
    StoreError,
    StoreErrorCode,
)
from tpflex_controller.rendezvous.service import RendezvousServicer, add_rendezvous

__all__ = ["RendezvousLimits", "RendezvousServicer", "StoreError", "StoreErrorCode", "add_rendezvous"]
