"""``ControllerEvents``: tpflex-run tells the controller when a rank's process ended
abnormally (``ReportRankExit``), so the survivors learn of it from the plan stream (a
soft failure: the GPU is healthy, the plan keeps it) instead of from a transport error.

Reports are sent by one background thread with bounded retries across the controller
endpoints: the supervisor's loop never waits for the controller.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc
from tpflex_proto import controller_pb2, controller_pb2_grpc
from tpflex_proto.backoff import Backoff

from tpflex_trainer.hooks.control import ControlConfig, open_channel
from tpflex_trainer.launch.policy import Decision, describe_exit

log = logging.getLogger(__name__)


# the pause between tries: 0.2 s doubling to 2 s, jittered (tpflex_proto.backoff), so the
# tpflex-runs of a job that all report during one controller outage do not retry in lockstep
RETRY_INITIAL_S, RETRY_MAX_S = 0.2, 2.0


class ControllerEvents:
    def __init__(self, config: ControlConfig, node: str, *, tries: int = 5) -> None:
        self.config, self.node, self.tries = config, node, tries
        self.sent = 0
        self._q: queue.Queue = queue.Queue(maxsize=256)
        self._stop = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}
        self._thread = threading.Thread(target=self._run, name="tpflex-run-report", daemon=True)

    def start(self) -> ControllerEvents:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
        self._stop.set()
        for ch in self._channels.values():
            ch.close()

    # ---- RankEvents ----

    def rank_started(self, rank) -> None:
        pass

    def rank_exited(self, rank, returncode: int, decision: Decision | None) -> None:
        if decision is None:
            return  # a clean exit, or the node is draining
        reason = rank.kill_reason or describe_exit(returncode)
        exit_ = controller_pb2.RankExit(job=self.config.job, node=self.node, gpu=rank.gpu.index,
                                        incarnation=len(rank.restarted_at), reason=reason)
        try:
            self._q.put_nowait(exit_)
        except queue.Full:
            log.warning("rank exit not reported (queue full) node=%s gpu=%d", self.node, rank.gpu.index)

    def rank_given_up(self, rank) -> None:
        pass

    # ---- sending ----

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            try:
                self._send(item)
            except Exception as exc:  # noqa: BLE001 -- e.g. a TLS file gone: the next exits still get their try
                log.warning("rank exit not reported node=%s gpu=%d error=%r", item.node, item.gpu, exc)

    def _send(self, exit_: controller_pb2.RankExit) -> None:
        backoff = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        for attempt in range(self.tries):
            endpoint = self.config.endpoints[attempt % len(self.config.endpoints)]
            try:
                stub = controller_pb2_grpc.TrainerStub(self._channel(endpoint))
                stub.ReportRankExit(exit_, timeout=self.config.call_timeout_s)
                self.sent += 1
                log.info("rank exit reported node=%s gpu=%d incarnation=%d reason=%s", exit_.node,
                         exit_.gpu, exit_.incarnation, exit_.reason)
                return
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      grpc.StatusCode.ABORTED):
                    log.warning("rank exit refused node=%s gpu=%d code=%s detail=%s", exit_.node, exit_.gpu,
                                exc.code().name, exc.details())
                    return
            if attempt + 1 < self.tries and self._stop.wait(backoff.next()):
                return
        log.warning("rank exit not reported node=%s gpu=%d tries=%d", exit_.node, exit_.gpu, self.tries)

    def _channel(self, endpoint: str) -> grpc.Channel:
        if endpoint not in self._channels:
            self._channels[endpoint] = open_channel(self.config, endpoint)
        return self._channels[endpoint]
