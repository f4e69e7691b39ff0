"""``tpflexctl racks list | apply | propose`` against a live API (real etcd, real
uvicorn): the dry run prints the field and plan changes and writes nothing, apply is
idempotent, --prune, exit 2 on bad input with nothing written, propose's YAML applied back
once its budgets are filled."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tpflex_cli import main as cli
from tpflex_proto import codec, keys, types_pb2

from tests.controller import api_harness as h


def _rack(name: str, nodes: list[str], budget: float = h.T * 1300.0) -> dict:
    return {"name": name, "domain_size": len(nodes) * h.GPUS_PER_NODE, "power_budget_w": budget,
            "gpu_tdp_w": 1000.0, "gpu_min_w": 200.0, "gpu_max_w": 1300.0, "nodes": nodes,
            "gpus_per_node": h.GPUS_PER_NODE}


def _seeded() -> list[dict]:
    return [_rack(r, [h.node_name(r, i) for i in range(h.NODES_PER_RACK)]) for r in h.RACKS]


@pytest.fixture
def ctl(api, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TPFLEX_TOKEN_FILE", raising=False)
    monkeypatch.setenv("TPFLEX_URL", api.url)
    admin = tmp_path / "admin.token"
    admin.write_text(h.ADMIN + "\n")
    reader = tmp_path / "reader.token"
    reader.write_text(h.READER + "\n")

    def run(*argv: str, token: Path | None = admin) -> tuple[int, str, str]:
        code = cli.main((["--token-file", str(token)] if token else []) + list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    run.api, run.dir, run.reader = api, tmp_path, reader
    return run


def _file(ctl, racks: list[dict] | str, name: str = "inventory.yaml") -> str:
    path = ctl.dir / name
    path.write_text(racks if isinstance(racks, str) else yaml.safe_dump({"racks": racks}))
    return str(path)


def _raw(api) -> dict[str, tuple[bytes, int]]:
    kvs, _ = api.etcd.get_prefix(keys.RACKS)
    return {kv.key: (kv.value, kv.mod_revision) for kv in kvs}


def _stored(api, rack: str) -> types_pb2.Rack | None:
    kv = api.etcd.get(keys.rack(rack))
    return codec.decode(types_pb2.Rack, kv.value, kv.key) if kv is not None else None


def test_racks_and_racks_list_print_the_table(ctl):
    for argv in (["racks"], ["racks", "list"], ["racks", "list", "--limit", "1"]):
        code, out, _ = ctl(*argv)
        assert code == 0 and out.splitlines()[0].split()[:3] == ["RACK", "DOMAIN", "NODES"]
        assert "rack-a" in out and ("rack-b" in out) == (argv[-1] != "1")


def test_dry_run_prints_field_and_plan_changes_and_writes_nothing(ctl):
    h.put_health(ctl.api.store, "rack-a-n1", {2: (types_pb2.GPU_FAILED, "xid 79")})
    racks = _seeded()
    racks[0]["power_budget_w"] = 7000.0
    before = _raw(ctl.api)
    code, out, err = ctl("racks", "apply", "-f", _file(ctl, racks), "--dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert "rack rack-a: changed" in lines and "rack rack-b: unchanged" in lines
    assert "  power_budget_w: 10400 -> 7000" in lines
    assert any(ln.startswith(f"  job {h.JOB}: its next plan is recomputed") for ln in lines)
    assert "    replica 0 local_batch: 32 -> 28" in lines
    assert any(ln.startswith("    power cap 1253 W -> TDP: rack-a-n0:0") for ln in lines), out
    assert "    expected_throughput_ratio: 1 -> 0.9375" in lines
    assert lines[-1] == "dry run: nothing written: 1 changed, 1 unchanged"
    assert _raw(ctl.api) == before


def test_apply_writes_then_is_idempotent(ctl):
    racks = _seeded()
    racks[1]["power_budget_w"] = 9000.0
    racks.append(_rack("rack-c", ["rack-c-n0"], 4000.0))
    path = _file(ctl, racks)
    code, out, err = ctl("racks", "apply", "-f", path)
    assert code == 0, err
    assert "rack rack-b: changed" in out and "rack rack-c: created" in out and "rack rack-a: unchanged" in out
    assert out.splitlines()[-1] == "applied: 1 changed, 1 created, 1 unchanged"
    assert _stored(ctl.api, "rack-b").power_budget_w == 9000.0
    assert list(_stored(ctl.api, "rack-c").nodes) == ["rack-c-n0"]
    before = _raw(ctl.api)
    code, out, _ = ctl("racks", "apply", "-f", path)
    assert code == 0 and out.splitlines()[-1] == "applied: 3 unchanged"
    assert _raw(ctl.api) == before  # not even a rewrite of the same value


def test_prune_deletes_the_racks_the_file_does_not_list(ctl):
    ctl.api.store.put_rack(types_pb2.Rack(**_rack("rack-c", ["rack-c-n0"], 4000.0)))
    path = _file(ctl, _seeded())
    code, out, _ = ctl("racks", "apply", "-f", path)
    assert code == 0 and "rack rack-c: not in the file, kept (--prune deletes it)" in out
    assert _stored(ctl.api, "rack-c") is not None
    code, out, _ = ctl("racks", "apply", "-f", path, "--prune", "--dry-run")
    assert code == 0 and "rack rack-c: deleted (not in the file: --prune)" in out
    assert _stored(ctl.api, "rack-c") is not None
    code, out, _ = ctl("racks", "apply", "-f", path, "--prune")
    assert code == 0 and "rack rack-c: deleted (not in the file: --prune)" in out
    assert _stored(ctl.api, "rack-c") is None and _stored(ctl.api, "rack-a") is not None


def test_prune_of_a_rack_a_job_uses_is_refused_and_nothing_is_written(ctl):
    racks = _seeded()
    racks[0]["power_budget_w"] = 9000.0
    before = _raw(ctl.api)
    code, _, err = ctl("racks", "apply", "-f", _file(ctl, racks[:1]), "--prune")
    assert code == 2 and "nothing was written" in err
    assert "rack rack-b (--prune)" in err and h.JOB in err and "HTTP 409" in err
    assert _raw(ctl.api) == before  # rack-a's valid change was not written either


BAD_FILES = [
    ("racks: [\n  - name: x\n    nodes: [a, b\n", "is not valid YAML"),
    ("- name: rack-a\n", "must be a mapping with one key, racks"),
    ("racks: {name: rack-a}\n", "must be a mapping with one key, racks"),
    ("racks: []\nextra: 1\n", "must be a mapping with one key, racks"),
    ("racks:\n  - 5\n", "racks[0] is not a mapping"),
    ("racks:\n  - {name: rack-a, colour: red}\n", "unknown field 'colour'"),
    ("racks:\n  - {domain_size: 8}\n", "name (a string) is required"),
    ("racks:\n  - {name: rack-a}\n  - {name: rack-a}\n", "rack rack-a is listed twice"),
    ("racks:\n  - {name: rack-a, power_budget_w: FILL-ME}\n", "FILL-ME placeholder"),
]


@pytest.mark.parametrize("text,why", BAD_FILES, ids=[str(i) for i in range(len(BAD_FILES))])
def test_bad_files_exit_2_and_write_nothing(ctl, text, why):
    before = _raw(ctl.api)
    code, out, err = ctl("racks", "apply", "-f", _file(ctl, text))
    assert code == 2 and why in err and out == "", err
    assert err.count("\n") == 1  # one line
    assert _raw(ctl.api) == before


@pytest.mark.parametrize("change,why", [
    ({"power_budget_w": 1000.0}, "below domain_size 8 x gpu_min_w 200 W"),
    ({"gpu_tdp_w": "1000"}, "gpu_tdp_w"),
    ({"domain_size": 6}, "= 8 GPUs"),
    ({"nodes": ["rack-a-n0"], "domain_size": 4}, f"job {h.JOB} uses it"),
])
def test_server_refusals_exit_2_with_the_rack_and_message(ctl, change, why):
    racks = _seeded()
    racks[0].update(change)
    racks[1]["power_budget_w"] = 9000.0  # valid, and not written because rack-a is refused
    before = _raw(ctl.api)
    for extra in ([], ["--dry-run"]):
        code, _, err = ctl("racks", "apply", "-f", _file(ctl, racks), *extra)
        assert code == 2 and "rack rack-a:" in err and why in err, err
    assert _raw(ctl.api) == before


def test_apply_needs_an_admin_token(ctl):
    racks = _seeded()
    racks[0]["power_budget_w"] = 9000.0
    before = _raw(ctl.api)
    for token in (ctl.reader, None):
        code, _, err = ctl("racks", "apply", "-f", _file(ctl, racks), "--dry-run", token=token)
        assert code == 2 and ("HTTP 403" in err or "HTTP 401" in err), err
    assert _raw(ctl.api) == before


def _register(api, node: str, rack: str, gpus: int, source: str = "fabric", min_w: float = 200.0) -> None:
    devices = [types_pb2.GpuDevice(index=i, name="sim-B200", default_limit_w=1000.0, min_limit_w=min_w,
                                   max_limit_w=1300.0 - i, fabric_clique_id=3) for i in range(gpus)]
    api.etcd.put(keys.node(node), codec.encode(types_pb2.Node(
        name=node, rack=rack, rack_source=source, agent_address=f"{node}:7000", gpus=devices)))


def test_propose_groups_unassigned_nodes_and_applies_once_budgets_are_filled(ctl):
    api = ctl.api
    # an NVL domain of three nodes (rack "nvl0", reported from the fabric), listed out of order
    for n in ("nvl0-n10", "nvl0-n2", "nvl0-n1"):
        _register(api, n, "nvl0", 4, min_w=250.0 if n == "nvl0-n2" else 200.0)
    _register(api, "hgx-7", "", 8, source="default")  # no rack reported: a rack of its own
    assert len(api.http.get("/v1/status").json()["unassigned_nodes"]) == 4
    code, out, err = ctl("racks", "propose")
    assert code == 0, err
    proposal = yaml.safe_load(out)
    by_name = {r["name"]: r for r in proposal["racks"]}
    assert sorted(by_name) == ["hgx-7", "nvl0"]  # the seeded racks' nodes are assigned
    nvl = by_name["nvl0"]
    assert nvl["nodes"] == ["nvl0-n1", "nvl0-n2", "nvl0-n10"]
    assert (nvl["domain_size"], nvl["gpus_per_node"]) == (12, 4)
    assert (nvl["gpu_min_w"], nvl["gpu_tdp_w"], nvl["gpu_max_w"]) == (250, 1000, 1297)
    assert nvl["power_budget_w"] == "FILL-ME" and "REQUIRED" in out and "at least 3000" in out
    assert (by_name["hgx-7"]["nodes"], by_name["hgx-7"]["domain_size"]) == (["hgx-7"], 8)

    raw = _file(ctl, out, "proposal.yaml")
    before = _raw(api)
    code, _, err = ctl("racks", "apply", "-f", raw)
    assert code == 2 and "FILL-ME placeholder" in err and _raw(api) == before

    filled = _file(ctl, out.replace("FILL-ME", "12000"), "filled.yaml")
    code, out, err = ctl("racks", "apply", "-f", filled)
    assert code == 0 and "rack nvl0: created" in out and "rack hgx-7: created" in out, err
    stored = _stored(api, "nvl0")
    assert list(stored.nodes) == ["nvl0-n1", "nvl0-n2", "nvl0-n10"] and stored.power_budget_w == 12000.0
    assert api.http.get("/v1/status").json()["unassigned_nodes"] == []
    code, out, _ = ctl("racks", "propose")
    assert code == 0 and yaml.safe_load(out) == {"racks": []}
    code, out, _ = ctl("racks", "propose", "--all")
    assert code == 0 and {r["name"] for r in yaml.safe_load(out)["racks"]} == {"rack-a", "rack-b", "nvl0", "hgx-7"}


def test_status_lists_unassigned_nodes(ctl):
    code, out, _ = ctl("status")
    assert code == 0 and "unassigned node" not in out
    _register(ctl.api, "stray-n0", "rack0", 4)
    code, out, _ = ctl("status")
    assert code == 0 and "unassigned node stray-n0: no rack record 'rack0'" in out.splitlines()
