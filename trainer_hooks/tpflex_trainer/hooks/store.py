"""``ControllerStore``: a ``torch.distributed.Store`` backed by the control plane.

The rendezvous of a job goes through the controller's ``Rendezvous`` service (every
replica serves it; state in etcd), not through a process on one training host, so a rank
on any node can rendezvous as long as one controller replica is reachable. It follows the
c10d Store contract: ``get``/``wait`` block until the keys exist or the store's timeout
passes (then ``DistStoreError``), ``add`` keeps decimal counters, ``compare_set`` answers
like TCPStore. The timeout bounds waiting for keys; an operation that waits for none
(``set``, ``add``, ...) gets at least one call's timeout to reach a replica, however short
the store's is. Usable with ``init_process_group(store=...)`` on gloo and NCCL.

    store = ControllerStore(ControlConfig(endpoints=..., job=..., rank=...))

Beyond c10d: while ``give_up`` (a callable, None by default) returns true, a blocking
``get``/``wait`` ends early with ``DistStoreError`` (on its clones too): the hooks set it
while process groups are being formed, so a member that died after the round formed
blocks the others only until the controller announces a newer round, not for the whole
timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from tpflex_trainer.hooks.control import ControlConfig
from tpflex_trainer.hooks.store_client import RendezvousClient, StoreUnreachable


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class ControllerStore(dist.Store):
    def __init__(self, config: ControlConfig, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self.config = config
        self.client = RendezvousClient(config)
        self._give_up: list[Callable[[], bool] | None] = [None]  # shared with clones
        self.set_timeout(timeout)

    @property
    def give_up(self) -> Callable[[], bool] | None:
        return self._give_up[0]

    @give_up.setter
    def give_up(self, fn: Callable[[], bool] | None) -> None:
        self._give_up[0] = fn

    def _deadline(self, timeout: timedelta | None = None) -> float:
        t = (timeout if timeout is not None else self.timeout).total_seconds()
        return time.monotonic() + (t if t > 0 else 365 * 86400.0)  # 0: c10d's "no timeout"

    def _call_deadline(self) -> float:
        """A non-blocking operation's deadline: the store's timeout, but never less than one
        call's (``ControlConfig.call_timeout_s``). The timeout bounds waiting for keys to
        appear; a short one must not fail a ``set`` whose first try met a replica that was
        down, or a channel still connecting."""
        return max(self._deadline(), time.monotonic() + self.config.call_timeout_s)

    def _op(self, fn, *args):
        try:
            return fn(*args)
        except StoreUnreachable as exc:
            raise dist.DistStoreError(str(exc)) from None

    # ---- the c10d Store interface ----

    def set(self, key: str, value) -> None:
        self._op(self.client.set, key, _bytes(value), self._call_deadline())

    def get(self, key: str) -> bytes:
        value = self._op(self.client.get, key, self._deadline(), self.give_up)
        if value is None:
            raise dist.DistStoreError(f"{self._why(self.timeout)} waiting for key {key!r} (job {self.client.job})")
        return value

    def add(self, key: str, value: int) -> int:
        return self._op(self.client.add, key, int(value), self._call_deadline())

    def check(self, keys: Sequence[str]) -> bool:
        return self._op(self.client.check, list(keys), self._call_deadline())

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if not self._op(self.client.wait, list(keys), self._deadline(timeout), self.give_up):
            waited = timeout if timeout is not None else self.timeout
            raise dist.DistStoreError(f"{self._why(waited)} waiting for keys {list(keys)!r} (job {self.client.job})")

    def _why(self, waited: timedelta) -> str:
        return "given up (a newer round)" if self.give_up is not None and self.give_up() else f"timed out after {waited}"

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        return self._op(self.client.compare_set, key, _bytes(expected_value), _bytes(desired_value), self._call_deadline())

    def delete_key(self, key: str) -> bool:
        return self._op(self.client.delete_key, key, self._call_deadline())

    def num_keys(self) -> int:
        return self._op(self.client.num_keys, self._call_deadline())

    def clone(self) -> ControllerStore:
        twin = ControllerStore(self.config, self.timeout)
        twin._give_up = self._give_up  # a give-up condition set later applies to both
        return twin

    # ---- beyond c10d ----

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix`` (the hooks drop finished generations)."""
        return self._op(self.client.delete_prefix, prefix, self._call_deadline())

    def close(self) -> None:
        self.client.close()
