"""The plan encoder's byte caches are bounded LRUs (planbytes.py): the assignments and
caps of superseded plans leave them, and a small cache gives the same bytes as protobuf's
encoding of the whole plan."""

from __future__ import annotations

import dataclasses
import gc
import random
import tracemalloc

import pytest
from tpflex_controller import convert
from tpflex_controller.planbytes import Lru, PlanEncoder
from tpflex_controller.planner import plan
from tpflex_controller.planner.incremental import Changes, replan
from tpflex_controller.planner.model import ReplicaAssignment, release_evicted
from tpflex_proto import codec, planstore

from tests.controller.planner_fixtures import failed, make_job, make_racks, state


def test_lru_drops_the_least_recently_used_entry():
    lru = Lru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # "b" is now the oldest
    lru.put("c", 3)
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (1, None, 3, 2)
    with pytest.raises(ValueError):
        Lru(0)


def test_lru_setdefault_keeps_an_entry_or_makes_one():
    lru = Lru(2)
    first = lru.setdefault("a", dict)
    first[1] = b"x"
    assert lru.setdefault("a", dict) is first  # kept, and now the newest
    lru.put("b", {})
    assert lru.setdefault("a", dict) is first  # refreshed: "b" is the oldest
    made = lru.setdefault("c", dict)
    assert made == {} and made is not first
    assert (lru.get("b"), lru.get("a"), len(lru)) == (None, first, 2)


def _marked(mark: str) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is ReplicaAssignment and o.reason.startswith(mark))


def test_replaced_assignments_do_not_stay_alive_in_the_encoder():
    """Every generation brings a new assignment (as a failure or recovery does); once the
    caller drops the results, at most the cache's limit of them are still alive."""
    racks = make_racks(2, size=8)
    base = plan(state(racks), make_job(racks, tp=8))
    encoder = PlanEncoder(max_replicas=16)
    mark = f"bound-{id(encoder)}-"
    for gen in range(1, 301):
        first = dataclasses.replace(base.replicas[0], reason=f"{mark}{gen}")
        result = dataclasses.replace(base, replicas=(first, *base.replicas[1:]), cap_parts=None)
        encoder.encode(result, gen)
        encoder.split(result, gen)
    del result, first
    release_evicted()  # the planner's memos, as the reconcile loop releases them when idle
    gc.collect()
    assert _marked(mark) <= 16


def test_caps_of_old_plans_leave_the_encoder():
    """A new cap value per generation (boosts change with each failure): the memory the
    encoder keeps stays that of its limit, not of every (GPU, watts) ever encoded."""
    racks = make_racks(1, size=8)
    base = plan(state(racks), make_job(racks, tp=8))
    gpus = base.replicas[0].stages[0].gpus
    encoder = PlanEncoder(max_caps=64)
    tracemalloc.start()
    try:
        for gen in range(1, 3001):
            caps = {g: 700.0 + gen + i / 10 for i, g in enumerate(gpus)}
            encoder.encode(dataclasses.replace(base, power_caps=caps, cap_parts=None), gen)
            if gen == 500:
                gc.collect()
                early = tracemalloc.get_traced_memory()[0]
        gc.collect()
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # 20,000 more (GPU, watts) entries of ~150 bytes each would be ~3 MB
    assert late - early < 200_000


def test_a_tiny_cache_gives_the_same_bytes_through_replans():
    racks = make_racks(6, size=8)
    job = make_job(racks, tp=8, units={"heads": 64, "ffn": 128, "vocab": 64})
    gpus = [g for r in racks.values() for g in r.gpus]
    rng = random.Random(3)
    tiny, roomy = PlanEncoder(max_replicas=1, max_caps=1), PlanEncoder()
    down: set = set()
    jp = None
    for gen in range(1, 30):
        changed = set(rng.sample(gpus, rng.randrange(1, 4)))
        down ^= changed
        jp = replan(jp, state(racks, gpu_status=failed(*sorted(down))), job,
                    Changes(nodes=frozenset(g[0] for g in changed)))
        result = jp.result
        reference = codec.encode(convert.plan_to_proto(result, gen, cause="t", now=5.0))
        assert tiny.encode(result, gen, cause="t", now=5.0) == reference
        header, parts = tiny.split(result, gen, cause="t", now=5.0)
        assert planstore.Assembler().whole(header, parts) == reference
        assert (header, parts) == roomy.split(result, gen, cause="t", now=5.0)
