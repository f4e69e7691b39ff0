"""Two ``tpflex-run`` launchers as two "nodes" (2 ranks each) start the demo's training
script against a real control plane (etcd, controller, simulated agents): the ranks
rendezvous through the controller's store (TPFLEX_STORE=tpflex://, no TCPStore anywhere)
and train with the single-process reference's losses; the launchers keep the job's store
alive while they run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tpflex_proto import keys
from tpflex_trainer.demo.cluster import DemoCluster, DemoPorts, RackLayout
from tpflex_trainer.demo.launcher import demo_job_spec
from tpflex_trainer.demo.model import DEMO_MODEL
from tpflex_trainer.hooks.config import write_spec

from tests.e2e.support import free_base_port, reference_for, rel_diff
from tests.launch.support import RUN, base_env

STEPS, LOCAL_BATCH = 6, 4
RACKS = (RackLayout("rack-0", "node-0", 2), RackLayout("rack-1", "node-1", 2))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_launchers_train_a_job_through_the_controllers_rendezvous(tmp_path):
    cluster = DemoCluster(DemoPorts(free_base_port()), RACKS, tmp_path / "cluster")
    spec = demo_job_spec("launched", [(r.name, r.node, r.gpus) for r in RACKS], LOCAL_BATCH,
                         DEMO_MODEL.unit_counts())
    write_spec(spec, tmp_path / "job.json")
    out = tmp_path / "steps.jsonl"
    env = base_env(TPFLEX_DEMO_OUT=str(out), TPFLEX_DEMO_STEPS=str(STEPS), GLOO_SOCKET_IFNAME="lo")
    launchers = []
    try:
        cluster.start()
        for r in RACKS:
            launchers.append(subprocess.Popen(
                [RUN, "--controller", cluster.trainer_endpoint, "--job-spec", str(tmp_path / "job.json"),
                 "--node", r.node, "--log-dir", str(tmp_path / r.node), "--",
                 sys.executable, "-m", "tpflex_trainer.demo.worker"],
                env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{r.node}.log", "wb"),
                start_new_session=True))
        statuses = [p.wait(timeout=200) for p in launchers]
        store_keys = cluster.etcd.count_prefix(keys.rendezvous_keys("launched"))
        lease = cluster.etcd.get(keys.rendezvous_lease("launched"))
    finally:
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        cluster.stop()
    logs = {r.node: (tmp_path / f"{r.node}.log").read_text()[-2000:] for r in RACKS}
    assert statuses == [0, 0], logs
    records = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert sorted({r["rank"] for r in steps}) == [0, 1, 2, 3]
    losses = {r["step"]: r["loss"] for r in steps if r["rank"] == 0}
    assert sorted(losses) == list(range(STEPS))
    reference = reference_for({s: LOCAL_BATCH * len(RACKS) for s in losses})
    assert max(rel_diff(losses[s], reference[s]) for s in losses) < 1e-5
    # the rendezvous went through the controller: keys in etcd, bound to the job's lease
    assert store_keys > 0 and lease is not None
    for node, text in logs.items():
        assert "all ranks done" in text and "store=tpflex://" in text, (node, text)
