"""Job specs from the model (issue 39, part 3): ``tpflexctl job-spec --model DIR`` derives
the unit families and counts from a Hugging Face model directory exactly as the trainers'
adapter does, and records them in the spec's ``model`` block; the controller refuses a
spec whose units contradict that block (gRPC RegisterJob: INVALID_ARGUMENT; REST PUT
/v1/jobs/{job}/spec: 422) and a registering trainer whose adapter's counts contradict the
spec (FAILED_PRECONDITION; the hooks raise RefusedByController). Real etcd, a real gRPC
server, a real uvicorn, the real CLI in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2

from tests.controller import api_harness as h
from tests.controller.controller_harness import small_cluster
from tests.deploy.tools import DEPLOY

TPFLEXCTL = str(Path(sys.executable).parent / "tpflexctl")
MAKE_JOB_SPEC = str(DEPLOY / "slurm" / "make-job-spec.py")
# small_cluster: rack0, rack1, each 2 nodes x 2 GPUs (one 4-GPU domain per rack)
GRPC_ALLOC = ["--nodes", "rack0-n00 rack0-n01 rack1-n00 rack1-n01", "--gpus-per-node", "2",
              "--nodes-per-domain", "2", "--rack-pattern", "rack{domain}", "--local-batch", "4"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny model directories: Llama with grouped KV heads (8 query / 4 KV; saved with its
    weights by save_pretrained), Qwen2 (4 / 2, config only), Mixtral (MoE, config only)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config

    base = tmp_path_factory.mktemp("models")
    llama = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4)
    AutoModelForCausalLM.from_config(llama).save_pretrained(base / "llama")
    Qwen2Config(vocab_size=192, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(base / "qwen2")
    MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, num_local_experts=4).save_pretrained(base / "mixtral")
    (base / "empty").mkdir()
    return {p.name: p for p in base.iterdir()}


def run(*args: str, command: str | None = None) -> subprocess.CompletedProcess:
    argv = [TPFLEXCTL, "job-spec"] if command is None else [sys.executable, command]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=180, check=False)


def job_spec(model: Path, name: str, *alloc: str) -> types_pb2.JobSpec:
    p = run("--model", str(model), "--name", name, *alloc)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return json_format.Parse(p.stdout, types_pb2.JobSpec())


def adapter_counts(model: Path, base_tp: int) -> dict[str, int]:
    from tpflex_trainer.ntp.hf_adapter import HfAdapter

    return dict(HfAdapter.from_pretrained_dir(model, base_tp).unit_counts)


def counts(units) -> dict[str, int]:
    return {u.name: u.count for u in units}


@pytest.fixture
def trainer(etcd):
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=8)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.TrainerStub(channel), port
    finally:
        channel.close()
        server.stop(grace=1).wait()


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("family, want", [
    # 8 query heads over 4 KV groups at base TP 4: a unit is a KV group; vocab 256 and FFN 128
    # in the smallest divisor >= 4 x 4 = 16 blocks
    ("llama", {"attn": 4, "vocab": 16, "ffn": 16}),
    # 4 query heads over 2 KV heads at base TP 4 (above the KV heads): a unit is a query head
    # (KV heads replicated); vocab 192 in 16 blocks, FFN 96 in 16
    ("qwen2", {"attn": 4, "vocab": 16, "ffn": 16}),
])
def test_printed_spec_registers_with_the_adapters_counts(etcd, trainer, models, family, want):
    stub, _ = trainer
    small_cluster(etcd)
    spec = job_spec(models[family], f"{family}-job", *GRPC_ALLOC)
    assert spec.base_tp == 4 and [[st.rack for st in r.stages] for r in spec.replicas] == [["rack0"], ["rack1"]]
    assert counts(spec.units) == want == adapter_counts(models[family], 4)
    assert counts(spec.model.units) == want and spec.model.base_tp == 4
    assert spec.model.model_type == family
    config = json.loads((models[family] / "config.json").read_text())
    from tpflex_proto.jobspec import config_digest

    assert spec.model.config_sha256 == config_digest(config)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec), timeout=10)
    stored = codec.decode(types_pb2.JobSpec, etcd.get(keys.job_spec(spec.name)).value)
    assert counts(stored.units) == want and counts(stored.model.units) == want

    # the trainers register with the counts their adapter derived: accepted when they agree
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from tpflex_trainer.ntp.model_units import of_runtime_model

    mine = of_runtime_model(str(models[family]), HfAdapter.from_pretrained_dir(models[family], 4), 4)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec, model=mine), timeout=10)
    # a trainer whose model says otherwise (another model's config) is refused, family named
    other = types_pb2.ModelUnits()
    other.CopyFrom(mine)
    other.units[0].count = 2
    code, details = _refused(lambda: stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec, model=other),
                                                      timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "unit family 'attn': spec says 4, the trainer's model says 2" in details, details


def test_make_job_spec_script_prints_the_same_spec(models):
    args = ["--model", str(models["llama"]), "--name", "same", *GRPC_ALLOC]
    by_ctl, by_script = run(*args), run(*args, command=MAKE_JOB_SPEC)
    assert by_ctl.returncode == by_script.returncode == 0, (by_ctl.stderr, by_script.stderr)
    assert by_ctl.stdout == by_script.stdout and '"model"' in by_ctl.stdout


def test_hand_edited_contradicting_spec_is_refused_over_grpc(etcd, trainer, models):
    stub, _ = trainer
    small_cluster(etcd)
    printed = job_spec(models["llama"], "edited", *GRPC_ALLOC)

    def edited(name: str) -> types_pb2.JobSpec:
        spec = types_pb2.JobSpec()
        spec.CopyFrom(printed)
        spec.name = name
        return spec

    spec = edited("edited")
    spec.units[0].count = 8  # attn: the model's KV groups are 4
    code, details = _refused(lambda: stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "unit family 'attn': spec says 8, model config says 4" in details, details
    dropped = edited("dropped")
    del dropped.units[2]  # ffn left out
    code, details = _refused(lambda: stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=dropped), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unit family 'ffn': spec has no such family, model config says 16" in details, details
    moved = edited("moved")
    moved.model.base_tp = 2
    code, details = _refused(lambda: stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=moved), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "derived at base TP 2" in details, details
    jobs, _ = etcd.get_prefix(keys.JOBS)
    assert jobs == []  # nothing refused was stored


def test_hand_edited_contradicting_spec_is_refused_over_rest(models, api):
    body = json.loads(run("--model", str(models["llama"]), "--name", h.JOB, "--nodes", "a0 a1 b0 b1",
                          "--gpus-per-node", "4", "--nodes-per-domain", "2", "--rack-pattern", "r{domain}",
                          "--local-batch", "32", "--min-tp", "4", "--format", "rest").stdout)
    # the seeded cluster's racks and nodes (the rack pattern cannot spell them)
    for r, rack in enumerate(h.RACKS):
        stage = body["replicas"][r]["stages"][0]
        stage["rack"] = rack
        for g in stage["ranks"]:
            g["node"] = h.node_name(rack, int(g["node"][1:]))
    want = adapter_counts(models["llama"], 8)  # above the 4 KV heads: 8 query-head units
    assert {u["name"]: u["count"] for u in body["units"]} == want == {"attn": 8, "vocab": 32, "ffn": 32}
    ok = api.http.put(f"/v1/jobs/{h.JOB}/spec", json=body, headers=h.admin())
    assert ok.status_code == 202 and ok.json()["changed"] is True, ok.text
    stored = api.store.job_specs()[h.JOB]
    assert counts(stored.units) == want and stored.model.config_sha256 == body["model"]["config_sha256"]

    body["units"][0]["count"] = 4  # attn: above the 4 KV heads at base TP 8 the units are the 8 query heads
    bad = api.http.put(f"/v1/jobs/{h.JOB}/spec", json=body, headers=h.admin())
    assert bad.status_code == 422, bad.text
    assert "unit family 'attn': spec says 4, model config says 8" in bad.text, bad.text
    assert counts(api.store.job_specs()[h.JOB].units) == want  # unchanged


def test_moe_model_exits_2_with_the_adapters_reason(models):
    p = run("--model", str(models["mixtral"]), "--name", "moe", *GRPC_ALLOC)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    assert "the trainer's adapter refuses" in p.stderr and "experts" in p.stderr, p.stderr


@pytest.mark.parametrize("where, message", [
    ("missing", "is not a directory"),
    ("empty", "is not a Hugging Face model directory (no config.json)"),
])
def test_bad_model_path_exits_2_without_a_traceback(models, tmp_path, where, message):
    path = models.get(where, tmp_path / where)
    p = run("--model", str(path), "--name", "j", *GRPC_ALLOC)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("tpflexctl job-spec: error: --model: ") and message in p.stderr, p.stderr


def test_trainer_whose_model_contradicts_the_spec_is_refused_at_start(etcd, trainer, tmp_path):
    """TpflexHooks.start sends the units its adapter derived; the controller refuses them
    against a spec typed for another model and the hooks raise RefusedByController (the
    demo worker exits 2 with it), naming the family."""
    import torch.distributed as dist
    from tpflex_trainer.demo.launcher import demo_job_spec
    from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
    from tpflex_trainer.hooks.config import HooksConfig, write_spec
    from tpflex_trainer.hooks.trainer import RefusedByController, TpflexHooks

    _, port = trainer
    small_cluster(etcd, racks=1, nodes_per_rack=1, gpus_per_node=1)
    wrong = dict(DEMO_MODEL.unit_counts())
    wrong["ffn"] += 1
    spec = demo_job_spec("hooks-job", [("rack0", "rack0-n00", 1)], 4, wrong)
    write_spec(spec, tmp_path / "job.json")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    config = HooksConfig(controller=(f"127.0.0.1:{port}",), job="hooks-job", node="rack0-n00", gpu=0,
                         store=f"127.0.0.1:{store.port}", spec_file=str(tmp_path / "job.json"),
                         backend="gloo", plan_wait_s=5.0, collective_timeout_s=30.0)
    hooks = TpflexHooks(config, DEMO_MODEL, adam=DEMO_ADAM, seed=DEMO_SEED)
    try:
        with pytest.raises(RefusedByController) as info:
            hooks.start()
    finally:
        hooks.close()
    n = DEMO_MODEL.unit_counts()["ffn"]
    assert f"unit family 'ffn': spec says {n + 1}, the trainer's model says {n}" in str(info.value)
    assert etcd.get(keys.job_spec("hooks-job")) is None  # refused before anything was stored


def test_demo_worker_exits_2_with_the_refusal(etcd, trainer, tmp_path):
    """A rank (the demo's worker, a plain training script on TpflexHooks) whose model
    contradicts the spec ends with exit 2 and the controller's message, no traceback."""
    import os

    import torch.distributed as dist
    from tpflex_trainer.demo.launcher import demo_job_spec
    from tpflex_trainer.demo.model import DEMO_MODEL
    from tpflex_trainer.hooks.config import write_spec

    _, port = trainer
    small_cluster(etcd, racks=1, nodes_per_rack=1, gpus_per_node=1)
    wrong = dict(DEMO_MODEL.unit_counts())
    wrong["vocab"] *= 2
    write_spec(demo_job_spec("worker-job", [("rack0", "rack0-n00", 1)], 4, wrong), tmp_path / "job.json")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}
    env.update(TPFLEX_CONTROLLER=f"127.0.0.1:{port}", TPFLEX_JOB="worker-job", TPFLEX_NODE="rack0-n00",
               TPFLEX_GPU="0", TPFLEX_STORE=f"127.0.0.1:{store.port}", TPFLEX_JOB_SPEC=str(tmp_path / "job.json"),
               TPFLEX_BACKEND="gloo", TPFLEX_PLAN_WAIT_S="5", TPFLEX_DEMO_OUT=str(tmp_path / "out.jsonl"),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tpflex_trainer.demo.worker"], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    n = DEMO_MODEL.unit_counts()["vocab"]
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    assert f"unit family 'vocab': spec says {2 * n}, the trainer's model says {n}" in p.stderr, p.stderr[-2000:]
    assert etcd.get(keys.job_spec("worker-job")) is None
