"""The schedule of the lease keep-alives when some of them fail.

A real etcd cannot fail one chosen keep-alive, fast or at its deadline, on cue, so here a
scripted stand-in for the ``Etcd`` client (the object ``Membership`` is given) answers each
keep-alive from a script and records when it was called. The assertions are about that
schedule: a failed keep-alive is retried after the back-off alone, the back-off starts
over after each success, and successful refreshes stay less than a TTL apart.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import pytest
from tpflex_agent.membership import Membership
from tpflex_proto.etcd import EtcdUnavailable

from tests.agent.conftest import running_agent

OK, FAIL = "ok", "fail"


@dataclass
class Call:
    start: float
    end: float
    ok: bool


class ScriptedEtcd:
    """Stands in for ``tpflex_proto.etcd.Etcd``: every write succeeds, each keep-alive
    follows the script (``OK``, ``FAIL`` at once, or a number: fail after that many
    seconds, as a call that runs into its deadline does). ``done`` is set once the script
    has been played out."""

    def __init__(self, script: list[str | float], ttl_s: int) -> None:
        self.script, self.ttl_s = list(script), ttl_s
        self.calls: list[Call] = []
        self.done = threading.Event()
        self.leases = 0
        self._stalled = threading.Event()  # never set: a stalled etcd

    def grant_lease(self, ttl: int) -> int:
        self.leases += 1
        return 0x40 + self.leases

    def txn(self, compare, ops) -> bool:
        return True

    def put(self, *args, **kwargs) -> None:
        pass

    def revoke_lease(self, lease: int) -> None:
        pass

    def keepalive_once(self, lease: int) -> int:
        start = time.monotonic()
        step = self.script.pop(0) if self.script else OK
        if step != OK and step != FAIL:
            self._stalled.wait(float(step))  # the call's deadline runs out
        ok = step == OK
        self.calls.append(Call(start, time.monotonic(), ok))
        if not self.script:
            self.done.set()
        if not ok:
            raise EtcdUnavailable("injected keep-alive failure")
        return self.ttl_s


@pytest.fixture
def agent():
    with running_agent("k1", 2) as a:
        yield a


def play(agent, script: list[str | float], ttl_s: int) -> list[Call]:
    fake = ScriptedEtcd(script, ttl_s)
    m = Membership(fake, agent.core, agent_address="x:1", ttl_s=ttl_s).start()
    try:
        assert fake.done.wait(5 * ttl_s + 10), fake.calls
    finally:
        m.stop(revoke=False)
    assert fake.leases == 1, "the lease was never given up"
    return fake.calls


def retry_gaps(calls: list[Call]) -> list[float]:
    """From the end of each failed keep-alive to the start of the next attempt."""
    return [b.start - a.end for a, b in itertools.pairwise(calls) if not a.ok]


def test_a_keepalive_that_times_out_is_retried_after_the_backoff_within_the_lease(agent):
    # TTL 3 s, a refresh every 1 s; the second keep-alive runs 1.2 s into its deadline
    # (the default 2 s deadline against the default 5 s TTL, scaled)
    ttl = 3
    calls = play(agent, [OK, 1.2, OK, OK], ttl)
    assert [c.ok for c in calls] == [True, False, True, True]
    # the first back-off is at most 0.1 s; the rest is slack for a loaded machine
    assert max(retry_gaps(calls)) < 0.7, retry_gaps(calls)  # the old loop: 1.08 s (back-off + TTL/3)
    oks = [c.start for c in calls if c.ok]
    gaps = [b - a for a, b in itertools.pairwise(oks)]
    assert max(gaps) < ttl - 0.3, f"refreshes {gaps} s apart, lease TTL {ttl} s"


def test_backoff_starts_over_after_each_successful_keepalive(agent):
    # a fast failure now and then over the agent's life: each retry is a first retry
    ttl = 3
    calls = play(agent, [OK, FAIL] * 4 + [OK], ttl)
    assert [c.ok for c in calls] == [True, False] * 4 + [True]
    # a first back-off is at most 0.1 s; without a reset the fourth is 0.4-0.5 s
    assert max(retry_gaps(calls)) < 0.3, retry_gaps(calls)
