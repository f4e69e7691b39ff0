"""The planner's identity memo (planner/memo.py): an entry lives exactly as long as its
key object, and the planner's memo of identity assignments keeps no job spec alive."""

from __future__ import annotations

import gc
import weakref

from tpflex_controller.planner import GpuStatus, plan
from tpflex_controller.planner import planner as planner_module
from tpflex_controller.planner.memo import IdentityMemo
from tpflex_controller.planner.model import ReplicaSpec, StageSpec

from tests.controller.planner_fixtures import make_job, make_racks, state


class _Key:
    """A weak-referenceable key."""


def test_an_entry_is_found_for_its_key_and_goes_when_the_key_is_freed():
    memo: IdentityMemo[str] = IdentityMemo()
    a, b = _Key(), _Key()
    memo.put(a, "a")
    assert memo.get(b, lambda k: "b") == "b"
    assert (memo.peek(a), memo.peek(b), len(memo)) == ("a", "b", 2)
    assert memo.get(a, lambda k: "recomputed") == "a"  # a hit does not compute
    del a
    assert len(memo) == 1 and memo.peek(b) == "b"
    del b
    assert len(memo) == 0


def test_a_new_object_at_a_freed_keys_address_is_not_found():
    memo: IdentityMemo[str] = IdentityMemo()
    key = _Key()
    old = id(key)
    memo.put(key, "old")
    del key
    # CPython reuses a freed block of the same size at once, typically for the next one
    fresh = [_Key() for _ in range(64)]
    assert any(id(k) == old for k in fresh), "no reuse of the freed address to test with"
    assert all(memo.peek(k) is None for k in fresh)


def test_a_replaced_entry_is_not_dropped_by_its_old_reference():
    memo: IdentityMemo[str] = IdentityMemo()
    key = _Key()
    memo.put(key, "first")
    memo.put(key, "second")  # the first entry's reference is freed with it, no callback
    assert memo.peek(key) == "second" and len(memo) == 1


def test_the_planners_memo_keeps_no_job_spec_alive():
    """A plan memoises the identity assignment of each healthy replica under its spec; once
    the caller drops the spec (a rack change rebuilds it), its entries and the spec go."""
    racks = make_racks(6, size=4)
    before = len(planner_module._IDENTITY)
    job = make_job(racks, 4)
    failed = state(racks, gpu_status={("r0-n0", 0): GpuStatus.FAILED})
    first = plan(failed, job)
    assert len(planner_module._IDENTITY) == before + len(job.replicas) - 1  # all but replica 0
    assert plan(failed, job) == first  # the hits give the same plan
    spec_ref = weakref.ref(job.replicas[1])
    del job, first
    gc.collect()  # a JobSpec is a plain frozen dataclass; nothing cyclic should hold it
    assert spec_ref() is None
    assert len(planner_module._IDENTITY) == before


def test_replica_specs_are_weak_referenceable_and_still_values():
    a = ReplicaSpec((StageSpec("r", (("n", 0),)),))
    b = ReplicaSpec((StageSpec("r", (("n", 0),)),))
    assert weakref.ref(a)() is a
    assert a == b and hash(a) == hash(b)
