"""tpflex-run's rank-exit report (``ControllerEvents``) against a real gRPC Trainer server
that answers UNAVAILABLE (a controller restarting): the pauses between tries come from
the shared jittered back-off (0.2 s doubling to 2 s, each drawn from [half, all] of its
step), so the tpflex-runs that report during one outage do not retry in lockstep."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from tpflex_proto import controller_pb2, controller_pb2_grpc
from tpflex_trainer.hooks.control import ControlConfig
from tpflex_trainer.launch import report
from tpflex_trainer.launch.devices import LocalGpu
from tpflex_trainer.launch.policy import Decision
from tpflex_trainer.launch.supervisor import Rank

TRIES = 5


class _Trainer(controller_pb2_grpc.TrainerServicer):
    """Refuses every report with ``code`` (None: accepts it); counts the calls."""

    def __init__(self, code: grpc.StatusCode | None) -> None:
        self.code = code
        self.calls: list[controller_pb2.RankExit] = []
        self.lock = threading.Lock()

    def ReportRankExit(self, request, context):
        with self.lock:
            self.calls.append(request)
        if self.code is not None:
            context.abort(self.code, "controller restarting")
        return controller_pb2.RankExitResponse()


class _Pauses(threading.Event):
    """The reporter's stop event, recording each pause it is asked to wait instead of
    waiting it (the test needs the schedule, not the wall-clock time)."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None or self.is_set():
            return super().wait(timeout)
        self.pauses.append(timeout)
        return False


@pytest.fixture
def trainer(request):
    servicer = _Trainer(request.param)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    controller_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _report_once(endpoint: str) -> tuple[report.ControllerEvents, list[float]]:
    """One rank exit reported through a fresh ControllerEvents: its pauses between tries."""
    events = report.ControllerEvents(ControlConfig(endpoints=(endpoint,), job="j", rank=0, call_timeout_s=5.0),
                                     "node-a", tries=TRIES)
    pauses = _Pauses()
    events._stop = pauses  # the one thing replaced: the clock of its waits
    events.start()
    events.rank_exited(Rank(local_rank=0, gpu=LocalGpu(3)), -9, Decision(True, 0.5, 0))
    events.stop(timeout=30)  # the queue's end marker: returns once the report is done
    assert not events._thread.is_alive()
    return events, pauses.pauses


@pytest.mark.parametrize("trainer", [grpc.StatusCode.UNAVAILABLE], indirect=True)
def test_retry_pauses_are_jittered_within_the_backoff_bounds(trainer):
    servicer, endpoint = trainer
    runs = [_report_once(endpoint)[1] for _ in range(3)]
    assert len(servicer.calls) == 3 * TRIES  # every try reached the server
    assert {(c.node, c.gpu, c.reason) for c in servicer.calls} == {("node-a", 3, "signal:SIGKILL")}
    # jitter: three reporters (three tpflex-runs) do not pause in lockstep
    assert len({tuple(p) for p in runs}) == 3, runs
    for pauses in runs:  # each pause within [half, all] of its step: 0.2 s doubling to 2 s
        for i, pause in enumerate(pauses):
            step = min(report.RETRY_MAX_S, report.RETRY_INITIAL_S * 2 ** i)
            assert step / 2 <= pause <= step, (i, pauses)
        assert len(pauses) == TRIES - 1, pauses  # no pointless pause after the last try


@pytest.mark.parametrize("trainer", [None], indirect=True)
def test_an_accepted_report_is_sent_once_without_a_pause(trainer):
    servicer, endpoint = trainer
    events, pauses = _report_once(endpoint)
    assert events.sent == 1 and len(servicer.calls) == 1 and pauses == []


def test_an_unusable_channel_loses_one_report_not_the_reporter(tmp_path, caplog):
    """A TLS file that cannot be read (here a directory) raised out of the report thread,
    which died: every later rank exit went unreported, without a word. Now each is logged
    as not reported and the thread goes on."""
    config = ControlConfig(endpoints=("127.0.0.1:9",), job="j", rank=0, call_timeout_s=1.0,
                           tls_ca_file=str(tmp_path))
    events = report.ControllerEvents(config, "node-a", tries=1).start()
    for gpu in (3, 5):
        events.rank_exited(Rank(local_rank=0, gpu=LocalGpu(gpu)), -9, Decision(True, 0.5, 0))
    events.stop(timeout=30)  # returns once both are done
    assert not events._thread.is_alive()
    lost = [r.getMessage() for r in caplog.records if "rank exit not reported" in r.getMessage()]
    assert len(lost) == 2 and "gpu=3" in lost[0] and "gpu=5" in lost[1], lost
