"""A transaction built in place (``TxnBuilder``) is the request ``Etcd.txn`` builds from
``Cmp`` and ``Op`` messages, byte for byte (pure: no etcd; the commit tests send them)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from pyetcd import etcdrpc
from tpflex_proto.etcd import Cmp, Op, TxnBuilder

_keys = st.binary(max_size=40)
_revisions = st.one_of(st.sampled_from([0, 1, 127, 128, (1 << 63) - 1]), st.integers(0, 1 << 40))
_steps = st.lists(st.one_of(
    st.tuples(st.just("mod"), _keys, _revisions),
    st.tuples(st.just("absent"), _keys.filter(bool)),
    st.tuples(st.just("put"), _keys, st.binary(max_size=300)),
    st.tuples(st.just("delete"), _keys),
), max_size=12)


@settings(max_examples=300, deadline=None)
@given(_steps)
def test_a_transaction_built_in_place_is_the_one_built_from_messages(steps):
    txn, compare, success = TxnBuilder(), [], []
    for step in steps:
        kind, key = step[0], step[1]
        if kind == "mod":
            txn.mod_revision_is(key, step[2])
            compare.append(Cmp.mod_revision(key, "==", step[2]))
        elif kind == "absent":
            cmp = Cmp.prefix_absent(key)
            txn.compare(cmp)
            compare.append(cmp)
        elif kind == "put":
            txn.put(key, step[2])
            success.append(Op.put(key, step[2]))
        else:
            op = Op.delete(key)
            txn.op(op)
            success.append(op)
    txn.on_failure(Op.get(b"/leader"))
    want = etcdrpc.TxnRequest(compare=compare, success=success, failure=[Op.get(b"/leader")])
    assert txn.request.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert txn.request == want

    # the bulk forms: mod-revision compares from pairs, puts from (key, value) pairs
    # among messages, in order
    bulk = TxnBuilder()
    bulk.mod_revisions_are([(s[1], s[2]) for s in steps if s[0] == "mod"])
    for s in steps:
        if s[0] == "absent":
            bulk.compare(Cmp.prefix_absent(s[1]))
    bulk.ops([(s[1], s[2]) if s[0] == "put" else Op.delete(s[1]) for s in steps if s[0] in ("put", "delete")])
    bulk.on_failure(Op.get(b"/leader"))
    mods = [Cmp.mod_revision(s[1], "==", s[2]) for s in steps if s[0] == "mod"]
    absent = [Cmp.prefix_absent(s[1]) for s in steps if s[0] == "absent"]
    assert bulk.request == etcdrpc.TxnRequest(compare=[*mods, *absent], success=success, failure=[Op.get(b"/leader")])
