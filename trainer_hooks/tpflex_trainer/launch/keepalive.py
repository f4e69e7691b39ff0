"""Keeps the job's rendezvous store alive while this node runs ranks (``tpflex://``
stores: the store vanishes a TTL after the last write or keep-alive, docs/launch.md)."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from tpflex_trainer.hooks.control import ControlConfig
from tpflex_trainer.hooks.store_client import (
    RendezvousClient,
    StoreRefused,
    StoreUnreachable,
)

log = logging.getLogger("tpflex_run")


class StoreKeepAlive:
    def __init__(self, config: ControlConfig, *, retry_s: float = 5.0) -> None:
        self.client = RendezvousClient(config)
        self.retry_s = retry_s
        self.refreshed = 0
        self.failed = 0  # unexpected errors (not the store's answers): logged, then retried
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-keepalive", daemon=True)

    def start(self) -> StoreKeepAlive:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.client.close()  # cancels a call in flight
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.retry_s
            try:
                ttl = self.client.keepalive(time.monotonic() + self.retry_s)
                self.refreshed += 1
                wait = max(1.0, ttl / 3)
            except StoreRefused as exc:  # NOT_FOUND until a rank registers the job
                if self._stop.is_set():
                    return
                level = logging.DEBUG if exc.code == grpc.StatusCode.NOT_FOUND else logging.WARNING
                log.log(level, "rendezvous keep-alive refused job=%s error=%s", self.client.job, exc)
            except StoreUnreachable as exc:
                log.info("rendezvous keep-alive failed job=%s error=%s", self.client.job, exc)
            except Exception as exc:  # e.g. TLS files gone bad: say so, keep trying
                if self._stop.is_set():
                    return
                self.failed += 1
                log.warning("rendezvous keep-alive error job=%s error=%s: %s", self.client.job,
                            type(exc).__name__, exc, exc_info=self.failed == 1)
            self._stop.wait(wait)
