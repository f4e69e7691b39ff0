"""The REST API under generated and unauthorised input: schemathesis over the served
OpenAPI (every operation, no 5xx, every 4xx with a message), and no token / a wrong token
/ a read-only token on every mutating operation (401 / 401 / 403, nothing written)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from tpflex_proto.etcd import Etcd

from tests.controller import api_harness as h
from tests.reliability.fleet import record
from tests.support.rest import rest_error

EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.support.etcd_server import EtcdCluster

    base = tmp_path_factory.mktemp("rel-api")
    cluster = EtcdCluster(1, base / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    h.write_token_file(base)
    served = h.serve(etcd, base)
    h.seed(served.store)
    try:
        yield served
    finally:
        served.http.close()
        served.app_server.stop()
        etcd.close()
        cluster.stop()


@pytest.fixture(scope="module")
def schema(served):
    return schemathesis.openapi.from_url(served.url + "/openapi.json")


def _mutating(schema) -> list:
    """Writes: every non-GET operation that answers 202 (dry-run answers 200, writes nothing)."""
    ops = [r.ok() for r in schema.get_all_operations()]
    return [op for op in ops if op.method.upper() != "GET" and "202" in op.definition.raw["responses"]]


def _fuzz(op, base_url: str, calls: dict[str, int]) -> None:
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def check(case):
        case.headers = {**(case.headers or {}), **h.admin()}
        resp = case.call(base_url=base_url, timeout=10)
        assert resp.status_code < 500, (op.label, case.path_parameters, case.body, resp.text)
        if resp.status_code >= 400:
            calls["4xx"] += 1
            rest_error(resp)
        else:
            calls["2xx"] += 1

    check()


def test_schemathesis_every_operation_no_5xx_and_4xx_with_a_message(served, schema):
    ops = [r.ok() for r in schema.get_all_operations()]
    calls = {"2xx": 0, "4xx": 0}
    for op in ops:
        _fuzz(op, served.url, calls)
        h.seed(served.store)  # writes (drain, reconfigure) must not pile up between operations
    assert len(ops) >= 15
    record("rest_schemathesis", f"schemathesis (up to {EXAMPLES_PER_OPERATION} generated requests per "
           "operation, admin token) on every operation of /openapi.json",
           "no 5xx; every 4xx has a typed error with a message",
           {"operations": len(ops), "requests_2xx": calls["2xx"], "requests_4xx": calls["4xx"]})


def test_every_mutating_operation_refuses_missing_wrong_and_read_only_tokens(served, schema):
    ops = sorted(_mutating(schema), key=lambda op: op.method.upper() == "DELETE")  # deletion last
    labels = sorted(op.label for op in ops)
    assert len(ops) >= 5, labels  # drain, undrain, reconfigure, spec change, job deletion
    params = {"node": h.node_name(h.RACKS[0], 0), "index": 0, "job": h.JOB}
    spec = h.job_spec()
    bodies = {
        "reconfigure": {"pins": [{"replica": 1, "tp_degree": 4}]},
        "spec": {"base_tp": spec.base_tp, "min_tp": spec.min_tp, "policy": spec.policy,
                 "global_batch": spec.global_batch, "local_batch": spec.local_batch,
                 "replicas": [{"stages": [{"rack": r}]} for r in h.RACKS],
                 "units": [{"name": u.name, "count": u.count, "bytes_per_unit": u.bytes_per_unit}
                           for u in spec.units]},
        h.JOB: None,  # DELETE /v1/jobs/{job}: no body
    }
    results = {}
    for op in ops:
        url = op.path.format(**params)
        body = next((b for k, b in bodies.items() if url.endswith(k)), {"reason": "auth test"})
        if op.method.upper() == "DELETE":
            body = None
        before = served.etcd.get_prefix("/tpflex/v1/")[1]
        got = []
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, h.reader(),
                        {"Authorization": h.READER}):
            resp = served.http.request(op.method.upper(), url, json=body, headers=headers)
            rest_error(resp)
            got.append(resp.status_code)
        assert got == [401, 401, 403, 401], (op.label, got)
        assert served.etcd.get_prefix("/tpflex/v1/")[1] == before, f"{op.label} wrote to etcd"
        ok = served.http.request(op.method.upper(), url, json=body, headers=h.admin())
        assert ok.status_code == 202, (op.label, ok.text)  # the same call with the admin token works
        results[op.label] = got
    h.seed(served.store)
    record("rest_auth", f"{len(ops)} mutating operations from /openapi.json ({', '.join(labels)}) "
           "with no token, a wrong token, a read-only token, a token without 'Bearer'",
           "401 / 401 / 403 / 401 with a message each, etcd revision unchanged; 202 with the admin token",
           {"operations": len(ops), "refusals": 4 * len(ops)})
