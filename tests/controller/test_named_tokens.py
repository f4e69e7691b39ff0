"""Named operator tokens (issue 40): the token file format, job/rack limits, the caller's
name on what it writes, and the audit record of every mutating REST call, against a
real etcd and the API served by a real uvicorn (the leader's side: test_named_tokens_e2e)."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from tpflex_controller.api import TokenFileError, load_tokens
from tpflex_controller.api.deps import Caller
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h

ALICE = "alice-tok-5f1e2d3c4b"
VIEWER = "viewer-tok-9a8b7c6d"
JOBS_OTHER = "other-tok-1a2b3c4d"
JOBS_LLAMA = "llama-tok-7e6f5a4b"
RACK_A = "racka-tok-0c9d8e7f"
BARE = "bare-tok-2468ace0"

ADMIN_FILE = f"""# operators
alice {ALICE}
ops-other {JOBS_OTHER} jobs=other,else   # limited to two jobs
ops-llama@site {JOBS_LLAMA} jobs=llama
rack.ops {RACK_A} racks=rack-a
{BARE}
"""
READER_FILE = f"viewer {VIEWER}\n"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- the token file ----


def _load(tmp_path, admin: str, reader: str = ""):
    (tmp_path / "admin").write_text(admin)
    (tmp_path / "ro").write_text(reader)
    return load_tokens(tmp_path / "admin", tmp_path / "ro")


def test_named_bare_and_limited_tokens_are_read(tmp_path):
    tokens = _load(tmp_path, ADMIN_FILE, READER_FILE)
    assert tokens.caller_of(ALICE) == Caller("alice", "admin")
    assert tokens.caller_of(VIEWER) == Caller("viewer", "read-only")
    assert tokens.caller_of(JOBS_OTHER) == Caller("ops-other", "admin", frozenset({"other", "else"}))
    assert tokens.caller_of(RACK_A) == Caller("rack.ops", "admin", None, frozenset({"rack-a"}))
    # a bare token (the old format) is named by its SHA-256, never by itself
    bare = tokens.caller_of(BARE)
    assert bare.name == "token-" + hashlib.sha256(BARE.encode()).hexdigest()[:8] and bare.scope == "admin"
    assert tokens.caller_of("alice") is None and tokens.caller_of(ALICE + "x") is None
    assert tokens.caller_of("") is None
    assert tokens.admin == frozenset({ALICE, JOBS_OTHER, JOBS_LLAMA, RACK_A, BARE})
    # what a limited caller may change
    other = tokens.caller_of(JOBS_OTHER)
    assert other.may_change_job("other") and not other.may_change_job("llama")
    assert not other.may_change_rack("rack-a")  # a jobs= limit names no rack: none
    racks = tokens.caller_of(RACK_A)
    assert racks.may_change_rack("rack-a") and not racks.may_change_rack("rack-b")
    assert not racks.may_change_rack(None) and not racks.may_change_job("llama")
    alice = tokens.caller_of(ALICE)
    assert alice.may_change_job("anything") and alice.may_change_rack(None)
    assert ALICE not in repr(tokens)  # the entries' repr leaves the tokens out


@pytest.mark.parametrize("admin,reader,where,why", [
    ("alice t1\nbob t2\nalice t3\n", "", "admin line 1 and", "'alice' is used twice"),
    ("alice t1\n", "alice t2\n", "ro line 1", "'alice' is used twice"),
    ("alice t1\nbob t1\n", "", "admin line 2", "the same token is listed twice"),
    ("al!ce t1\n", "", "admin line 1", "a token's name is 1-64 of"),
    ("a" * 65 + " t1\n", "", "admin line 1", "a token's name is 1-64 of"),
    ("alice t1 extra\n", "", "admin line 1", "expected '<name> <token>"),
    ("# c\nalice t1 jobs=\n", "", "admin line 2", "jobs= needs a comma-separated list"),
    ("alice t1 racks=a,,b\n", "", "admin line 1", "racks= needs"),
    ("alice t1 jobs=a jobs=b\n", "", "admin line 1", "jobs= given twice"),
    ("jobs=a racks=b\n", "", "admin line 1", "no token, only limits"),
    ("", "viewer t1 jobs=a\n", "ro line 1", "limits are for admin tokens"),
])
def test_bad_token_lines_name_the_file_and_line_never_the_token(tmp_path, admin, reader, where, why):
    with pytest.raises(TokenFileError) as exc:
        _load(tmp_path, admin, reader)
    msg = str(exc.value)
    assert why in msg and where in msg, msg
    for secret in ("t1", "t2", "t3"):
        assert secret not in msg.replace("t1 ", "")  # no token echoed


def test_a_token_named_after_a_bad_name_is_not_echoed(tmp_path):
    with pytest.raises(TokenFileError) as exc:
        _load(tmp_path, "s3cr3t/tok alice\n")  # reversed fields: the "name" is the secret
    assert "s3cr3t" not in str(exc.value) and "line 1" in str(exc.value)


# ---- the API, served over a real etcd ----


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    base = tmp_path_factory.mktemp("named-tokens")
    (base / "admin.tokens").write_text(ADMIN_FILE)
    (base / "readonly.tokens").write_text(READER_FILE)
    with h.served_api(base, write_tokens=False) as served:
        h.seed(served.store)
        yield served


@pytest.fixture
def audit(caplog):
    """The ``tpflex.audit`` records written meanwhile, decoded."""
    caplog.set_level(logging.INFO, logger="tpflex.audit")

    def records() -> list[dict]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tpflex.audit"]

    return records


DRAIN = "/v1/nodes/rack-a-n0/gpus/1/drain"
DRAIN_WHAT = "POST /v1/nodes/{node}/gpus/{index}/drain"


def _gpu_override(api, node: str, index: int) -> types_pb2.GpuOverride | None:
    kv = api.etcd.get(keys.gpu_override(node, index))
    return codec.decode(types_pb2.GpuOverride, kv.value) if kv is not None else None


def test_a_drain_records_the_callers_name_and_one_audit_line(api, audit):
    r = api.http.post(DRAIN, json={"reason": "flaky NVLink"},
                      headers={**bearer(ALICE), "X-Request-Id": "ticket-42.a"})
    assert r.status_code == 202, r.text
    assert r.headers["X-Request-Id"] == "ticket-42.a"
    assert _gpu_override(api, "rack-a-n0", 1).by == "alice"
    [rec] = audit()
    assert rec["who"] == "alice" and rec["what"] == DRAIN_WHAT and rec["target"] == DRAIN
    assert rec["outcome"] == "ok" and rec["status"] == 202 and rec["request_id"] == "ticket-42.a"
    assert rec["reason"] == "flaky NVLink" and isinstance(rec["ts"], float)
    # undrain: by the token's name, no body, no reason; a fresh request id echoed
    r = api.http.post("/v1/nodes/rack-a-n0/gpus/1/undrain", headers=bearer(BARE))
    assert r.status_code == 202, r.text
    rec = audit()[-1]
    assert rec["who"] == "token-" + hashlib.sha256(BARE.encode()).hexdigest()[:8]
    assert rec["what"] == "POST /v1/nodes/{node}/gpus/{index}/undrain" and "reason" not in rec
    assert rec["request_id"] == r.headers["X-Request-Id"] and len(rec["request_id"]) == 16
    assert _gpu_override(api, "rack-a-n0", 1) is None


def test_refusals_are_audited_as_denied_with_the_tokens_name(api, audit):
    r = api.http.post(DRAIN, json={"reason": "x"}, headers=bearer(VIEWER))
    assert r.status_code == 403 and "read-only" in r.json()["error"]["message"]
    r = api.http.post(DRAIN, json={"reason": "x"}, headers=bearer("not-a-token"))
    assert r.status_code == 401
    r = api.http.post(DRAIN, json={"reason": "x"})
    assert r.status_code == 401
    r = api.http.post("/v1/nodes/rack-a-n0/gpus/1/undrain", headers=bearer(VIEWER))  # no body
    assert r.status_code == 403
    got = [(x["who"], x["outcome"], x["status"], x["what"]) for x in audit()]
    assert got == [
        ("viewer", "denied", 403, DRAIN_WHAT), ("anonymous", "denied", 401, DRAIN_WHAT),
        ("anonymous", "denied", 401, DRAIN_WHAT),
        ("viewer", "denied", 403, "POST /v1/nodes/{node}/gpus/{index}/undrain"),
    ]
    assert _gpu_override(api, "rack-a-n0", 1) is None  # nothing written
    assert all("not-a-token" not in json.dumps(x) for x in audit())


def test_limited_tokens_change_only_what_they_name(api, audit):
    r = api.http.post(f"/v1/jobs/{h.JOB}/reconfigure", json={"policy": "ntp", "reason": "x"},
                      headers=bearer(JOBS_OTHER))
    assert r.status_code == 403
    msg = r.json()["error"]["message"]
    assert "'ops-other' may not change job 'llama'" in msg and "limited to jobs else, other" in msg
    assert api.http.post(DRAIN, json={"reason": "x"}, headers=bearer(JOBS_OTHER)).status_code == 403
    assert api.http.delete(f"/v1/jobs/{h.JOB}", headers=bearer(JOBS_OTHER)).status_code == 403
    r = api.http.post("/v1/nodes/rack-b-n0/gpus/0/drain", json={"reason": "x"}, headers=bearer(RACK_A))
    assert r.status_code == 403 and "GPU rack-b-n0:0 (rack 'rack-b')" in r.json()["error"]["message"]
    assert api.http.post(f"/v1/jobs/{h.JOB}/reconfigure", json={"policy": "ntp"},
                         headers=bearer(RACK_A)).status_code == 403
    assert api.http.delete("/v1/racks/rack-b", headers=bearer(RACK_A)).status_code == 403
    assert _gpu_override(api, "rack-b-n0", 0) is None and api.etcd.get(keys.job_override(h.JOB)) is None
    assert [(x["who"], x["outcome"]) for x in audit()] == [("ops-other", "denied")] * 3 + [
        ("rack.ops", "denied")] * 3
    # within their limits they act, under their names
    r = api.http.post("/v1/nodes/rack-a-n1/gpus/2/drain", json={"reason": "rack work"}, headers=bearer(RACK_A))
    assert r.status_code == 202, r.text
    assert _gpu_override(api, "rack-a-n1", 2).by == "rack.ops"
    r = api.http.post(f"/v1/jobs/{h.JOB}/reconfigure", json={"policy": "ntp", "reason": "try ntp"},
                      headers=bearer(JOBS_LLAMA))
    assert r.status_code == 202, r.text
    assert r.json()["override"]["by"] == "ops-llama@site"
    stored = codec.decode(types_pb2.JobOverride, api.etcd.get(keys.job_override(h.JOB)).value)
    assert stored.by == "ops-llama@site"
    assert api.http.get(f"/v1/jobs/{h.JOB}").json()["override"]["by"] == "ops-llama@site"
    assert [(x["who"], x["outcome"], x["target"]) for x in audit()[-2:]] == [
        ("rack.ops", "ok", "/v1/nodes/rack-a-n1/gpus/2/drain"),
        ("ops-llama@site", "ok", f"/v1/jobs/{h.JOB}/reconfigure")]
    api.etcd.delete(keys.job_override(h.JOB))
    api.etcd.delete(keys.gpu_override("rack-a-n1", 2))


def test_outcomes_request_ids_and_what_is_not_audited(api, audit):
    r = api.http.post("/v1/nodes/rack-a-n0/gpus/99/drain", json={"reason": "x"}, headers=bearer(ALICE))
    assert r.status_code == 422
    r = api.http.post(DRAIN, json={"reason": ""}, headers=bearer(ALICE))  # reason required
    assert r.status_code == 422
    r = api.http.put("/v1/jobs/nope/spec", json={}, headers=bearer(ALICE))
    assert r.status_code in (404, 422)
    assert [(x["outcome"], x["what"]) for x in audit()] == [
        ("invalid", DRAIN_WHAT), ("invalid", DRAIN_WHAT), ("invalid", "PUT /v1/jobs/{job}/spec")]
    # a hostile body (nested 100,000 deep, with a "reason") is refused, and audited
    nested = '{"reason": "x", "pins": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = api.http.post(f"/v1/jobs/{h.JOB}/reconfigure", content=nested,
                      headers={**bearer(ALICE), "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert (audit()[-1]["outcome"], audit()[-1]["status"]) == ("invalid", 422)
    # a client's request id is bounded and cut to safe characters; an unusable one replaced
    r = api.http.post("/v1/nodes/rack-a-n0/gpus/1/undrain",
                      headers={**bearer(ALICE), "X-Request-Id": 'a b"c<d>\\' + "x" * 100})
    assert r.headers["X-Request-Id"] == ("abcd" + "x" * 100)[:64] == audit()[-1]["request_id"]
    r = api.http.post("/v1/nodes/rack-a-n0/gpus/1/undrain", headers={**bearer(ALICE), "X-Request-Id": "<>"})
    rid = r.headers["X-Request-Id"]
    assert len(rid) == 16 and rid == audit()[-1]["request_id"]
    # reads and a dry-run (it commits nothing) are not audited
    before = len(audit())
    assert api.http.get("/v1/racks").status_code == 200
    assert api.http.post(f"/v1/jobs/{h.JOB}/dry-run", json={}).status_code == 200
    assert len(audit()) == before


def test_tpflexctl_events_and_the_console_show_who():
    from pathlib import Path

    import tpflex_controller
    from tpflex_cli import main as cli

    events = [{"seq": 7, "at": 1790000000.0, "kind": "plan_committed", "job": "llama", "generation": 3,
               "cause": "drain", "by": "alice", "reasons": [], "phases": []},
              {"seq": 8, "at": 1790000001.0, "kind": "plan_committed", "job": "llama", "generation": 4,
               "cause": "gpu_failed", "by": "", "reasons": [], "phases": []}]
    header, alice, nobody = cli.show_events({"events": events}).splitlines()
    assert header.split() == ["SEQ", "AT", "KIND", "JOB", "GEN", "BY", "CAUSE"]
    assert alice.split()[-2:] == ["alice", "drain"] and nobody.split()[-2:] == ["-", "gpu_failed"]
    plan = {"job": "llama", "generation": 3, "policy": "ntp-pw", "expected_throughput_ratio": 0.9,
            "created_at": 1790000000.0, "cause": "drain", "by": "alice", "replicas": [],
            "power_caps": [], "suspended_pins": [], "reasons": []}
    assert "cause: drain by alice" in cli.show_plan(plan)
    # the console's decision list renders each event's "by" after its cause
    js = (Path(tpflex_controller.__file__).parent / "api/console/static/console.js").read_text()
    assert '${e.cause || "-"}${e.by ? ` by ${e.by}` : ""}' in js
