"""``tpflexctl events --watch`` (a real process running its main()) against a tiny real HTTP server
on loopback whose console stream misbehaves:

- it answers 200 and ends every stream at once (a REST child restarting behind a proxy),
  or sends only the ``error`` event the controller sends when its view loses etcd: the
  watch reconnects through the shared jittered back-off (one stderr line per reconnect),
  not in a tight loop, and Ctrl-C still ends it with 130;
- every stream delivers data and then ends: the back-off starts over each time;
- a stream message that is not JSON, or JSON of the wrong shape: one error line, exit 1
  (the documented code for a server error), no traceback, no reconnect."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

LAUNCH = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from tpflex_cli.main import main; sys.argv[0] = 'tpflexctl'; sys.exit(main())")
WINDOW_S = 2.0
FLOOD = 30  # requests: the original tight loop reached this within a few hundredths of a second
# the watch's back-off: Backoff(1.0, 10.0), each pause drawn from [half, all] of its step
INITIAL_S, MAX_S = 1.0, 10.0

EVENT = {"seq": 7, "at": 1_700_000_000.0, "kind": "plan", "job": "j", "generation": 3, "cause": "the-cause"}
BODIES = {
    "empty": b"",
    "error": b'event: error\ndata: {"code": "unavailable", "message": "etcd unavailable"}\n\n',
    "snapshot": b"event: snapshot\ndata: " + json.dumps({"events": [EVENT]}).encode() + b"\n\n",
    "badjson": b"event: snapshot\ndata: {not json\n\n",
    "badshape": b"event: snapshot\ndata: [1, 2]\n\n",
}
NOTICE = re.compile(r"^tpflexctl: (.*); reconnecting in (\d+\.\d) s$")


class _Stream:
    """An HTTP server whose every GET answers 200 with ``BODIES[mode]`` and ends; it
    records when each request arrived."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.hits: list[float] = []
        self.changed = threading.Condition()
        body = BODIES[mode]
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with outer.changed:
                    outer.hits.append(time.monotonic())
                    outer.changed.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_hits(self, n: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.hits) >= n, timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stream(request):
    s = _Stream(request.param)
    yield s
    s.close()


def _watch(url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}
    # tpflexctl's entry point with Ctrl-C's KeyboardInterrupt handler installed even when
    # the test runs in a background job, whose children inherit SIGINT ignored
    return subprocess.Popen([sys.executable, "-c", LAUNCH, "--url", url, "events", "--watch"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _interrupt(proc: subprocess.Popen) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"tpflexctl did not stop on SIGINT within 20 s: {err[-3000:]}") from None
    return proc.returncode, out, err


def _most_requests(window_s: float) -> int:
    """The most requests the back-off lets one watcher make within ``window_s`` of its
    first: each pause is at least half its step (steps INITIAL_S doubling to MAX_S)."""
    n, t, step = 1, 0.0, INITIAL_S
    while t + step / 2 <= window_s:
        t += step / 2
        n += 1
        step = min(MAX_S, step * 2)
    return n


@pytest.mark.parametrize("stream", ["empty", "error"], indirect=True)
def test_an_ended_stream_is_reconnected_with_jittered_backoff(stream):
    proc = _watch(stream.url)
    try:
        assert stream.wait_hits(1, 30), "tpflexctl never connected"
        first = stream.hits[0]
        # the window ends after WINDOW_S, or early once the server has seen a flood
        stream.wait_hits(FLOOD, WINDOW_S - (time.monotonic() - first))
        in_window = sum(1 for t in list(stream.hits) if t - first <= WINDOW_S)
    finally:
        code, out, err = _interrupt(proc)
    assert in_window <= _most_requests(WINDOW_S), f"{in_window} requests in {WINDOW_S} s; stderr ends: {err[-300:]!r}"
    assert code == 130 and "Traceback" not in err, err[-3000:]
    lines = err.splitlines()
    seen = len(stream.hits)
    # one notice per ended stream (the last one may not have been printed at Ctrl-C)
    assert seen - 1 <= len(lines) <= seen, (seen, lines)
    notices = [NOTICE.match(line) for line in lines]
    assert all(notices), lines
    expected = "the controller ended the stream" + (": etcd unavailable" if stream.mode == "error" else "")
    assert {m.group(1) for m in notices} == {expected}, lines
    # the pauses grow: no data came, so the back-off never starts over
    for i, m in enumerate(notices):
        step = min(MAX_S, INITIAL_S * 2 ** i)
        assert step / 2 - 0.05 <= float(m.group(2)) <= step + 0.05, (i, lines)
    assert out == ""


@pytest.mark.parametrize("stream", ["snapshot"], indirect=True)
def test_the_backoff_starts_over_after_a_stream_that_delivered_data(stream):
    proc = _watch(stream.url)
    try:
        assert stream.wait_hits(4, 30), f"{len(stream.hits)} requests"
    finally:
        code, out, err = _interrupt(proc)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    hits = list(stream.hits)
    gaps = [b - a for a, b in itertools.pairwise(hits)]
    assert all(g >= INITIAL_S / 2 for g in gaps), gaps  # never a tight loop
    notices = [NOTICE.match(line) for line in err.splitlines()]
    assert notices and all(notices), err
    # every stream delivered a snapshot: every pause is a first step's, [0.5, 1.0] s
    assert all(INITIAL_S / 2 - 0.05 <= float(m.group(2)) <= INITIAL_S + 0.05 for m in notices), err
    # the event is printed once, with its header, however often the stream repeats it
    assert out.count("the-cause") == 1 and out.startswith("SEQ"), out


@pytest.mark.parametrize("stream", ["badjson", "badshape"], indirect=True)
def test_an_unreadable_stream_message_is_one_error_line_and_exit_1(stream):
    proc = _watch(stream.url)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        code, out, err = _interrupt(proc)
        raise AssertionError(f"tpflexctl kept watching (exit {code} on SIGINT); stderr: {err[-2000:]}") from None
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith("tpflexctl: error: ") and "snapshot" in err, err
    assert len(stream.hits) == 1  # no reconnect: the next stream would say the same
    assert out == ""
