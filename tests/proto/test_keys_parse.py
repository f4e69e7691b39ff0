"""keys.parse(): every key the builders make parses back to its kind and parts; anything
else (foreign, malformed, truncated) is None."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from tpflex_proto import keys
from tpflex_proto.keys import Key, Kind

names = st.from_regex(keys.NAME_PATTERN, fullmatch=True)
jobs = st.from_regex(keys.JOB_NAME_PATTERN, fullmatch=True)
nums = st.integers(0, 10**9)


@given(names, jobs, nums, st.integers(0, 999_999))
def test_every_built_key_parses_back(name, job, n, pos):
    built = {
        keys.node(name): Key(Kind.NODE, name),
        keys.health(name): Key(Kind.HEALTH, name),
        keys.rack(name): Key(Kind.RACK, name),
        keys.power(name): Key(Kind.POWER, name),
        keys.job_spec(job): Key(Kind.JOB_SPEC, job),
        keys.job_plan(job): Key(Kind.JOB_PLAN, job),
        keys.job_plan_history(job, n): Key(Kind.JOB_HISTORY, job, n),
        keys.job_assign(job, n, pos): Key(Kind.JOB_ASSIGN, job, n, pos),
        keys.job_ack(job, n): Key(Kind.JOB_ACK, job, n),
        keys.gpu_override(name, n): Key(Kind.GPU_OVERRIDE, name, n),
        keys.gpu_hold(name, n): Key(Kind.GPU_HOLD, name, n),
        keys.job_override(job): Key(Kind.JOB_OVERRIDE, job),
        keys.event(n): Key(Kind.EVENT, number=n),
        keys.LEADER: Key(Kind.LEADER),
        keys.SPEC_GUARD: Key(Kind.SPEC_GUARD),
    }
    for key, want in built.items():
        assert keys.parse(key) == want, key
    assert keys.parse(keys.health(name)).node == name
    assert keys.parse(keys.gpu_override(name, n)).node == name
    assert keys.parse(keys.gpu_hold(name, n)).node == name
    assert keys.parse(keys.job_spec(job)).node is None


def test_foreign_and_malformed_keys_are_none():
    for key in [
        "/other/v1/nodes/a", keys.NODES, keys.JOBS + "j", keys.JOBS + "j/", keys.JOBS + "/spec",
        keys.JOBS + "j/acks/x", keys.JOBS + "j/assign/12", keys.JOBS + "j/assign/x/1",
        keys.JOBS + "j/history/", keys.JOBS + "j/unknown", keys.GPU_OVERRIDES + "n/x",
        keys.GPU_OVERRIDES + "/3", keys.HOLDS + "n/x", keys.HOLDS + "/3", keys.HOLDS + "n",
        keys.EVENTS + "12a", keys.NODES + "a/b", keys.PREFIX + "steps/x",
    ]:
        assert keys.parse(key) is None, key
