"""Token files (one token per line) loading, protected reads, and a bounded fuzz of the live API: client input
never gets a 5xx, and every 4xx carries a typed error with a message."""

from __future__ import annotations

import socket
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tpflex_controller.api import TokenFileError, load_tokens
from tpflex_controller.api.limits import body_scope

from tests.controller import api_harness as h
from tests.support.rest import rest_error


def test_load_tokens_scopes(tmp_path):
    (tmp_path / "admin").write_text("a1\n# a comment\n\n  a2  # trailing comment\n")
    (tmp_path / "ro").write_text("r1\n")
    tokens = load_tokens(tmp_path / "admin", tmp_path / "ro", protect_reads=True)
    assert tokens.scope_of("a2").scope == "admin" and tokens.scope_of("r1").scope == "read-only"
    assert tokens.scope_of("a") is None and tokens.scope_of("") is None and tokens.protect_reads
    assert load_tokens().admin == frozenset() and not load_tokens().protect_reads


@pytest.mark.parametrize("admin,read_only,why", [
    ("a b c\n", "", "contains no whitespace"),
    ("x\n", "x\n", "both admin and read-only"),
])
def test_bad_token_files_are_refused_with_the_reason(tmp_path, admin, read_only, why):
    (tmp_path / "admin").write_text(admin)
    (tmp_path / "ro").write_text(read_only)
    with pytest.raises(TokenFileError, match=why) as exc:
        load_tokens(tmp_path / "admin", tmp_path / "ro")
    assert str(tmp_path / "admin") in str(exc.value)
    with pytest.raises(TokenFileError, match="cannot read"):
        load_tokens(tmp_path / "missing.tokens")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with h.served_api(tmp_path_factory.mktemp("api-auth"), protect_reads=True) as served:
        h.seed(served.store)
        yield served


def test_protected_reads_accept_either_scope(served):
    assert served.http.get("/v1/racks").status_code == 401
    assert served.http.get("/v1/racks", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert served.http.get("/v1/racks", headers=h.reader()).status_code == 200
    assert served.http.get("/v1/racks", headers=h.admin()).status_code == 200
    assert served.http.get("/healthz").status_code == 200  # probes stay open
    resp = served.http.post(f"/v1/jobs/{h.JOB}/dry-run", json={}, headers=h.reader())
    assert resp.status_code == 200


_names = st.text(alphabet=string.ascii_letters + string.digits + "-_.:%~ ", min_size=1, max_size=40)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["reason", "pins", "policy", "fail", "replica", "tp_degree", "node", "index", "clear", "x"]), inner, max_size=4),
    max_leaves=12,
)
_paths = st.sampled_from([
    "/v1/nodes/{n}/gpus/{i}/drain", "/v1/nodes/{n}/gpus/{i}/undrain", "/v1/jobs/{n}/reconfigure",
    "/v1/jobs/{n}/dry-run", "/v1/jobs/llama/reconfigure", "/v1/jobs/llama/dry-run",
    "/v1/nodes/rack-a-n0/gpus/{i}/drain",
])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=_paths, name=_names, index=st.integers(-5, 2**40), body=_json)
def test_fuzzed_requests_never_get_a_5xx(served, path, name, index, body):
    url = path.format(n=name, i=index).replace("%", "%25").replace(" ", "%20")
    resp = served.http.post(url, json=body, headers=h.admin())
    assert resp.status_code < 500, (url, body, resp.text)
    if resp.status_code >= 400:
        rest_error(resp)
    for get in (f"/v1/nodes/{name}", f"/v1/jobs/{name}/plan", f"/v1/racks/{name}"):
        resp = served.http.get(get.replace("%", "%25").replace(" ", "%20"), headers=h.reader())
        assert resp.status_code in (200, 404, 405, 422), (get, resp.text)


def test_the_token_is_checked_before_the_body_for_a_job_named_dry_run(served):
    """Only ``POST /v1/jobs/<job>/dry-run`` may send its body without an admin token; a job
    may be named ``dry-run``, and ``DELETE /v1/jobs/dry-run`` is a mutation: refused 401
    on its headers, not after waiting for a body that never comes."""
    assert body_scope("POST", "/v1/jobs/llama/dry-run", protect_reads=False) is None
    assert body_scope("POST", "/v1/jobs/llama/dry-run", protect_reads=True) == "reader"
    for method, path in (("DELETE", "/v1/jobs/dry-run"), ("PUT", "/v1/jobs/dry-run/spec"),
                         ("POST", "/v1/jobs/dry-run/reconfigure"), ("PUT", "/v1/jobs/x/dry-run"),
                         ("POST", "/v1/nodes/n/gpus/0/dry-run"), ("POST", "/v1/jobs//dry-run")):
        assert body_scope(method, path, protect_reads=False) == "admin", (method, path)
    with socket.create_connection(("127.0.0.1", served.app_server.port), timeout=5) as sock:
        sock.sendall(b"DELETE /v1/jobs/dry-run HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")  # the body never comes
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)  # a socket.timeout here: the server waited for the body
            assert chunk, answer
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].endswith(b" 401 Unauthorized"), answer
