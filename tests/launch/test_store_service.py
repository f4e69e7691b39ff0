"""The Rendezvous service as a hostile client and an operator see it: bad input is refused
with INVALID_ARGUMENT and changes nothing, the key space is bounded, state is bound to a
per-job lease (gone after its TTL, kept by keep-alives), a parked call is woken through
etcd by a write to another replica, and counters stay exact under contention."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest
import torch.distributed as dist
from tpflex_controller.rendezvous import RendezvousLimits
from tpflex_proto import keys, rendezvous_pb2_grpc
from tpflex_proto import rendezvous_pb2 as pb
from tpflex_trainer.hooks.control import ControlConfig
from tpflex_trainer.hooks.store import ControllerStore
from tpflex_trainer.hooks.store_client import StoreRefused

from tests.launch.conftest import serve
from tests.support.ports import free_port
from tests.support.wait import wait_until


@pytest.fixture
def stub(served):
    channel = grpc.insecure_channel(served.endpoint)
    yield rendezvous_pb2_grpc.RendezvousStub(channel)
    channel.close()


def code_of(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


def test_hostile_input_is_refused_with_a_message_and_changes_nothing(served, stub):
    job = served.new_job()
    stub.Set(pb.StoreSetRequest(job=job, key="keep", value=b"v"), timeout=10)
    bad = [
        (stub.Set, pb.StoreSetRequest(job=job, key="", value=b"x"), "key must not be empty"),
        (stub.Set, pb.StoreSetRequest(job=job, key="k" * 1025, value=b"x"), "1025 bytes"),
        (stub.Set, pb.StoreSetRequest(job=job, key="a\x00b", value=b"x"), "NUL"),
        (stub.Set, pb.StoreSetRequest(job=job, key="big", value=b"x" * ((1 << 20) + 1)), "at most 1048576"),
        (stub.Set, pb.StoreSetRequest(job="a/b", key="k", value=b"x"), "job must be a job name"),
        (stub.Check, pb.StoreKeysRequest(job=job, keys=[]), "at least one key"),
        (stub.Check, pb.StoreKeysRequest(job=job, keys=["k"] * 4097), "4097 keys"),
        (stub.Wait, pb.StoreWaitRequest(job=job, keys=[""], wait_ms=10), "must not be empty"),
        (stub.DeletePrefix, pb.StoreKeyRequest(job=job, key=""), "key prefix must not be empty"),
        (stub.CompareSet, pb.StoreCompareSetRequest(job=job, key="keep", expected=b"v",
                                                    desired=b"x" * ((1 << 20) + 1)), "desired is"),
    ]
    for call, request, message in bad:
        code, details = code_of(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (message, details)
    code, details = code_of(stub.Set, pb.StoreSetRequest(job="never-registered", key="k", value=b"x"))
    assert code == grpc.StatusCode.NOT_FOUND and "never-registered" in details
    stub.Set(pb.StoreSetRequest(job=job, key="n", value=b"seven"), timeout=10)
    code, details = code_of(stub.Add, pb.StoreAddRequest(job=job, key="n", delta=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not a 64-bit integer" in details
    assert stub.NumKeys(pb.StoreJobRequest(job=job), timeout=10).count == 2
    assert stub.Get(pb.StoreGetRequest(job=job, key="keep"), timeout=10).value == b"v"
    assert served.etcd.count_prefix(keys.rendezvous_prefix("never-registered")) == 0


def test_the_key_space_of_a_job_is_bounded(served):
    server, endpoint, _ = serve(served.etcd, RendezvousLimits(max_keys=100))
    store = ControllerStore(ControlConfig(endpoints=(endpoint,), job=served.new_job(), rank=0))
    try:
        for i in range(100):
            store.set(f"k{i}", b"1")
        with pytest.raises(StoreRefused, match="RESOURCE_EXHAUSTED.*100 rendezvous keys"):
            store.set("one-more", b"1")
        with pytest.raises(StoreRefused, match="RESOURCE_EXHAUSTED"):
            store.add("counter", 1)
        store.set("k7", b"overwritten")  # an existing key can still change
        assert store.delete_key("k0")
        store.set("one-more", b"1")  # room again
        assert store.num_keys() == 100
    finally:
        store.close()
        server.stop(0).wait()


def test_state_is_bound_to_one_lease_per_job_and_vanishes_after_its_ttl(served):
    server, endpoint, _ = serve(served.etcd, RendezvousLimits(ttl_s=2))
    kept_job, dropped_job = served.new_job(), served.new_job()
    kept = ControllerStore(ControlConfig(endpoints=(endpoint,), job=kept_job, rank=0))
    dropped = ControllerStore(ControlConfig(endpoints=(endpoint,), job=dropped_job, rank=0))
    try:
        for store in (kept, dropped):
            store.set("a", b"1")
            store.add("b", 5)
        kvs, _ = served.etcd.get_prefix(keys.rendezvous_prefix(dropped_job))
        leases = {kv.lease for kv in kvs}
        assert len(kvs) == 3 and len(leases) == 1 and 0 not in leases  # a, b and the lease record
        assert served.etcd.get(keys.rendezvous_lease(dropped_job)).value == str(leases.pop()).encode()
        stop = threading.Event()

        def keep_alive():  # what tpflex-run does, every ttl/3
            while not stop.wait(0.5):
                kept.client.keepalive(time.monotonic() + 5)

        t = threading.Thread(target=keep_alive)
        t.start()
        try:
            wait_until(lambda: served.etcd.count_prefix(keys.rendezvous_prefix(dropped_job)) == 0,
                       15, "the idle job's store to expire")
            assert kept.check(["a", "b"])  # refreshed past several TTLs: still there
        finally:
            stop.set()
            t.join()
        dropped.set("again", b"1")  # a new lease for the expired job
        assert dropped.num_keys() == 1
    finally:
        kept.close()
        dropped.close()
        server.stop(0).wait()


def test_a_parked_get_is_woken_through_etcd_by_a_write_to_another_replica(served):
    server_b, endpoint_b, _ = serve(served.etcd)
    job = served.new_job()
    channel_a, channel_b = grpc.insecure_channel(served.endpoint), grpc.insecure_channel(endpoint_b)
    a, b = rendezvous_pb2_grpc.RendezvousStub(channel_a), rendezvous_pb2_grpc.RendezvousStub(channel_b)
    try:
        with ThreadPoolExecutor(1) as pool:
            # parked for up to 60 s (the server caps it at max_wait_s=10 s) but the client
            # gives up after 8 s: only a wake-up by the watch can answer in time
            parked = pool.submit(a.Get, pb.StoreGetRequest(job=job, key="k", wait_ms=60_000), timeout=8)
            wait_until(lambda: job in served.rendezvous.waiters.watched_jobs(), 10,
                       "the parked call's watch")
            b.Set(pb.StoreSetRequest(job=job, key="k", value=b"from-b"), timeout=10)
            r = parked.result(timeout=10)
        assert r.found and r.value == b"from-b" and not r.busy
    finally:
        channel_a.close()
        channel_b.close()
        server_b.stop(0).wait()


def test_calls_beyond_the_parking_bound_answer_busy_at_once(served):
    server, endpoint, servicer = serve(served.etcd, RendezvousLimits(max_parked=1), max_workers=4)
    job = served.new_job()
    channel = grpc.insecure_channel(endpoint)
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(stub.Wait, pb.StoreWaitRequest(job=job, keys=["x"], wait_ms=60_000), timeout=30)
            wait_until(lambda: job in servicer.waiters.watched_jobs(), 15, "the first call to be parked")
            # parked up to 10 s if it got a slot: only an immediate busy answer beats 8 s
            second = stub.Wait(pb.StoreWaitRequest(job=job, keys=["y"], wait_ms=60_000), timeout=8)
            assert second.busy and not second.all_present
            stub.Set(pb.StoreSetRequest(job=job, key="x", value=b"1"), timeout=10)
            assert first.result(timeout=15).all_present
    finally:
        channel.close()
        server.stop(0).wait()


def test_counters_are_exact_under_contention_across_two_replicas(served):
    server_b, endpoint_b, _ = serve(served.etcd)
    job = served.new_job()
    stores = [ControllerStore(ControlConfig(endpoints=(ep,), job=job, rank=0))
              for ep in (served.endpoint, endpoint_b) for _ in range(3)]
    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            results = list(pool.map(lambda s: [s.add("ctr", 1) for _ in range(15)], stores))
        seen = sorted(v for r in results for v in r)
        assert seen == list(range(1, 91))  # every add saw a distinct value: none lost
        assert stores[0].get("ctr") == b"90"
    finally:
        for s in stores:
            s.close()
        server_b.stop(0).wait()


def test_the_store_fails_over_between_controller_endpoints(served):
    dead = f"127.0.0.1:{free_port()}"
    job = served.new_job()
    store = ControllerStore(ControlConfig(endpoints=(dead, served.endpoint), job=job, rank=0,
                                          call_timeout_s=0.5, backoff_max_s=0.1))
    store.set("k", b"v")
    assert store.get("k") == b"v"
    nowhere = ControllerStore(ControlConfig(endpoints=(dead,), job=job, rank=0, call_timeout_s=0.2,
                                            backoff_max_s=0.1), timeout=timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError, match="no controller answered"):
        nowhere.set("k", b"v")
    store.close()
    nowhere.close()
