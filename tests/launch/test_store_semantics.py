"""ControllerStore against c10d semantics: every operation sequence gives the same
answers (values, counters, exceptions) as torch's own in-memory ``HashStore``, run side by
side; the store runs over the real controller gRPC server on a real etcd."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tpflex_trainer.hooks.control import ControlConfig
from tpflex_trainer.hooks.rendezvous import forget_generation
from tpflex_trainer.hooks.store import ControllerStore

from tests.support.ports import free_port
from tests.support.wait import wait_until

SHORT = timedelta(seconds=0.3)


def store_for(served, job: str, timeout: timedelta = SHORT) -> ControllerStore:
    return ControllerStore(ControlConfig(endpoints=(served.endpoint,), job=job, rank=0), timeout=timeout)


def reference(timeout: timedelta = SHORT) -> dist.HashStore:
    ref = dist.HashStore()
    ref.set_timeout(timeout)
    return ref


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # the kind of failure must match, not its message
        return ("raised", isinstance(exc, dist.DistStoreError), isinstance(exc, ValueError))


KEYS = st.sampled_from(["a", "b", "pg/0/rank", "n"])
VALUES = st.sampled_from([b"", b"x", b"7", b"-3", b" +12z", b"  ", b"\x00\xffbin"])
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("add"), KEYS, st.integers(-5, 5)),
    st.tuples(st.just("check"), st.lists(KEYS, min_size=1, max_size=3)),
    st.tuples(st.just("compare_set"), KEYS, VALUES, VALUES),
    st.tuples(st.just("delete_key"), KEYS),
    st.tuples(st.just("num_keys")),
)


def apply(store, op):
    name, *args = op
    if name == "num_keys":
        return outcome(store.num_keys)
    return outcome(getattr(store, name), *args)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=12))
def test_every_operation_answers_like_torchs_hash_store(served, ops):
    # the outcomes compared (a value, or which error) do not depend on how long a get of a
    # missing key waits before its DistStoreError: the in-memory reference gives up at
    # once; the store keeps SHORT, its answers come over gRPC
    mine, ref = store_for(served, served.new_job("sem")), reference(timedelta(milliseconds=1))
    try:
        for op in ops:
            assert apply(mine, op) == apply(ref, op), op
    finally:
        mine.close()


def test_get_and_wait_block_until_another_client_sets_the_key(served):
    job = served.new_job()
    waiter, writer = store_for(served, job, timedelta(seconds=20)), store_for(served, job)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(value=waiter.get("late")))
    t.start()
    w = threading.Thread(target=lambda: got.update(waited=waiter.wait(["late", "later"]) or True))
    w.start()
    assert not got  # both block: nothing is there yet
    writer.set("late", b"v1")
    t.join(10)
    assert got.get("value") == b"v1"
    assert "waited" not in got  # "later" is still missing
    writer.set("later", "v2")  # str values are stored as UTF-8, as c10d does
    w.join(10)
    assert got.get("waited") is True and waiter.get("later") == b"v2"


def test_timeouts_raise_dist_store_error_after_the_store_timeout(served):
    store = store_for(served, served.new_job())
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.get("missing")
    assert time.monotonic() - t0 >= SHORT.total_seconds()
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"], timedelta(seconds=0.2))


def test_a_short_timeout_bounds_waiting_for_keys_not_reaching_a_replica(served):
    # the first endpoint is down: a set that gave up with the store's 1 ms timeout would
    # fail before trying the live replica; waiting for a missing key still ends at once
    down = f"127.0.0.1:{free_port()}"
    store = ControllerStore(ControlConfig(endpoints=(down, served.endpoint), job=served.new_job(), rank=0),
                            timeout=timedelta(milliseconds=1))
    try:
        store.set("k", b"v")
        assert store.add("n", 2) == 2 and store.check(["k", "n"])
        with pytest.raises(dist.DistStoreError, match="timed out"):
            store.get("missing")
        assert store.get("k") == b"v"
    finally:
        store.close()


def test_a_blocked_get_or_wait_gives_up_when_told_through_a_prefix_store(served):
    # what init_process_group does while a member that died after the round formed never
    # arrives: the hooks' give_up turns true when a newer round is announced
    store = store_for(served, served.new_job(), timedelta(seconds=300))
    told = threading.Event()
    store.give_up = told.is_set
    errors: dict = {}

    def blocked(name, fn):
        try:
            fn()
        except dist.DistStoreError as exc:
            errors[name] = (str(exc), time.monotonic())

    prefixed = dist.PrefixStore("pg/", store)
    threads = [threading.Thread(target=blocked, args=("get", lambda: prefixed.get("never"))),
               threading.Thread(target=blocked, args=("wait", lambda: prefixed.wait(["never"])))]
    for t in threads:
        t.start()
    assert not told.wait(1.0) and errors == {}  # still blocked: the store's timeout is 300 s
    told.set()
    t_told = time.monotonic()
    for t in threads:
        t.join(30)
    assert set(errors) == {"get", "wait"}
    assert all("given up" in msg and at - t_told < 30 for msg, at in errors.values()), errors
    store.give_up = None  # without it the store waits as c10d does (and sees a later write)
    prefixed.set("late", b"v")
    assert prefixed.get("late") == b"v"


def test_prefix_store_and_clone_see_the_same_keys(served):
    store = store_for(served, served.new_job())
    prefixed = dist.PrefixStore("p/", store)
    prefixed.set("k", b"1")
    assert prefixed.get("k") == b"1"
    assert store.num_keys() == 1 and not store.check(["k"])  # stored under the prefix
    assert dist.PrefixStore("p/", store.clone()).add("k", 2) == 3
    assert prefixed.get("k") == b"3"


def test_delete_prefix_drops_only_the_namespace(served):
    store = store_for(served, served.new_job())
    for key in ("tpflex/j/g1/a", "tpflex/j/g1/b", "tpflex/j/g10/a", "tpflex/j/world"):
        store.set(key, b"1")
    assert store.delete_prefix("tpflex/j/g1/") == 2
    assert not store.check(["tpflex/j/g1/a"]) and store.check(["tpflex/j/g10/a", "tpflex/j/world"])
    assert store.num_keys() == 2


def test_jobs_are_separate_namespaces(served):
    a, b = store_for(served, served.new_job()), store_for(served, served.new_job())
    a.set("k", b"a")
    assert not b.check(["k"])
    assert a.num_keys() == 1 and b.num_keys() == 0


def test_the_hooks_drop_a_finished_generations_namespace(served):
    store = store_for(served, served.new_job())
    kept = ["tpflex/j/g30//pg/0", "tpflex/j/world", "tpflex/j/g4//member/0/0"]
    for key in ["tpflex/j/g3//member/0/0", "tpflex/j/g3a//pg/1", *kept]:
        store.set(key, b"1")
    forget_generation(store, "j", 3)  # in the background: a step never waits for it
    wait_until(lambda: store.num_keys() == len(kept), 10, "generation 3's keys to go")
    assert store.check(kept)
    forget_generation(dist.HashStore(), "j", 3)  # a store without prefix deletes: nothing to do
