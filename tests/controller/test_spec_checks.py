"""The input checks of ``spec_checks`` (pure) and the goodput bound they guarantee
(hypothesis: whatever reports get through, every served figure stays within the job's
physical bound and finite)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import synthetic
from tpflex_controller.spec_checks import (
    InputError,
    JobFacts,
    check_ack,
    check_report,
    check_spec,
    job_facts,
    spec_difference,
)
from tpflex_controller.steps import StepStats
from tpflex_proto import controller_pb2, types_pb2

RACKS = {r.name: r for r in (synthetic.rack(f"rack{i}", 2, 2) for i in range(3))}


def _kind(fn, *args) -> str | None:
    try:
        fn(*args)
    except InputError as exc:
        return exc.kind
    return None


def _job(name="j", racks=("rack0", "rack1"), **kw) -> types_pb2.JobSpec:
    return synthetic.job(name, list(racks), 4, **kw)


def test_a_valid_spec_passes_and_each_defect_is_named():
    assert check_spec(_job(), RACKS, {}).base_tp == 4
    cases = {
        "name": _job(name="-x"),
        "global_batch": _job(),
        "twice": _job(racks=("rack0",)),
        "stage and spare": _job(racks=("rack0",)),
        "units": _job(),
    }
    cases["global_batch"].global_batch = 0
    cases["twice"].replicas[0].stages[0].ranks.extend(
        types_pb2.GpuRef(node="rack0-n00", index=i) for i in (0, 0, 1, 1))
    cases["stage and spare"].spare_racks.append("rack0")
    del cases["units"].units[:]
    for what, spec in cases.items():
        assert _kind(check_spec, spec, RACKS, {}) == "invalid", what
    two_stages = _job(racks=("rack0",))
    two_stages.replicas[0].stages.add(rack="rack0")  # the same rack twice: the same GPUs twice
    assert _kind(check_spec, two_stages, RACKS, {}) == "invalid"


def test_gpus_serve_one_job():
    held = {"a": _job("a", ("rack0",))}
    assert _kind(check_spec, _job("b", ("rack0",)), RACKS, held) == "conflict"
    assert _kind(check_spec, _job("b", ("rack1",)), RACKS, held) is None
    spare = _job("b", ("rack1",))
    spare.spare_racks.append("rack0")  # another job's stage as a spare: both could plan it
    assert _kind(check_spec, spare, RACKS, held) == "conflict"
    assert _kind(check_spec, _job("a", ("rack0",)), RACKS, held) is None  # itself is no conflict


def test_spec_difference_names_the_changed_fields():
    a, b = _job(), _job(racks=("rack0",))
    b.created_at = a.created_at + 5
    assert spec_difference(a, b) == ["replicas", "global_batch"]
    assert spec_difference(a, a) == []


FACTS = JobFacts(replicas=2, ranks=8, base_tp=4, local_batch=8, generation=3)


def _report(**kw):
    base = dict(job="j", rank=0, replica=0, step=1, generation=3, step_seconds=0.1, samples=8,
                tp_degree=4, base_tp=4)
    return controller_pb2.StepReport(**{**base, **kw})


@pytest.mark.parametrize(("fields", "kind"), [
    ({}, None), ({"replica": 2}, "invalid"), ({"rank": 8}, "invalid"),
    ({"samples": 9}, "invalid"), ({"samples": 0}, "invalid"), ({"step_seconds": 1e-9}, "invalid"),
    ({"step_seconds": math.nan}, "invalid"), ({"step_seconds": -math.inf}, "invalid"),
    ({"step_seconds": 1e6}, "invalid"), ({"tp_degree": 5}, "invalid"), ({"base_tp": 8}, "invalid"),
    ({"generation": 4}, "future"), ({"generation": 0}, "stale"), ({"generation": 2}, None),
])
def test_step_reports(fields, kind):
    assert _kind(check_report, _report(**fields), FACTS) == kind


@pytest.mark.parametrize(("fields", "stored", "kind"), [
    ({}, 0, None), ({}, 3, None), ({"generation": 2}, 3, "stale"), ({"generation": 4}, 0, "future"),
    ({"generation": 0}, 0, "invalid"), ({"rank": 8}, 0, "invalid"),
    ({"reshard_seconds": math.nan}, 0, "invalid"), ({"reshard_seconds": -1.0}, 0, "invalid"),
])
def test_acks(fields, stored, kind):
    ack = types_pb2.Ack(**{"job": "j", "rank": 1, "generation": 3, **fields})
    assert _kind(check_ack, ack, FACTS, stored) == kind


def test_job_facts_count_explicit_ranks():
    spec = _job(racks=("rack0",))
    assert job_facts(spec, 2) == JobFacts(1, 4, 4, 8, 2, 4)
    capped = _job(racks=("rack0",), units={"heads": 3, "ffn": 64})  # T = 3 of base_tp 4
    assert job_facts(capped, 2) == JobFacts(1, 4, 4, 8, 2, 3)


_floats = st.floats(allow_nan=True, allow_infinity=True) | st.floats(1e-4, 2.0)
_reports = st.builds(
    lambda replica, rank, step, gen, secs, samples, tp, dt: (_report(
        replica=replica, rank=rank, step=step, generation=gen, step_seconds=secs, samples=samples,
        tp_degree=tp), dt),
    st.integers(0, 3), st.integers(0, 9), st.integers(0, 40), st.integers(0, 4), _floats,
    st.integers(0, 2**32 - 1) | st.integers(1, 8), st.integers(0, 5), st.floats(0, 0.5))


@settings(max_examples=200, deadline=None)
@given(st.lists(_reports, max_size=60))
def test_whatever_gets_through_every_figure_stays_within_the_physical_bound(reports):
    now = [1000.0]
    steps = StepStats(clock=lambda: now[0])
    for r, dt in reports:
        now[0] += dt
        if _kind(check_report, r, FACTS) is None:
            steps.record(r)
    g = steps.goodput("j")
    if g is None:
        return
    bound = FACTS.replicas * FACTS.local_batch / 1e-3  # replicas x local batch / min step
    assert math.isfinite(g.achieved_samples_per_s) and 0 <= g.achieved_samples_per_s <= bound
    assert g.replicas_seen <= FACTS.replicas and g.replicas_reporting <= g.replicas_seen
    if g.ratio is not None:
        assert 0.0 <= g.ratio <= 1.0
    if g.failure_free_samples_per_s is not None:
        assert math.isfinite(g.failure_free_samples_per_s)


def test_a_spec_whose_smallest_unit_family_is_below_min_tp_is_refused():
    """The TP degree is at most the smallest unit count: with 2 units and min_tp 3 the
    leader would commit a plan that drops every replica (throughput 0)."""
    spec = _job(units={"heads": 2, "ffn": 64})
    spec.min_tp = 3
    with pytest.raises(InputError, match="unit family heads has 2 units, fewer than min_tp 3"):
        check_spec(spec, RACKS, {})
    spec.min_tp = 2  # as many units as min_tp: runs at TP 2
    assert check_spec(spec, RACKS, {}).min_tp == 2
    spec = _job(units={"heads": 1})
    assert check_spec(spec, RACKS, {}).min_tp == 1  # min_tp unset: 1
