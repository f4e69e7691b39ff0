"""The environment of one local rank (pure). What each variable means is in
docs/launch.md; the hooks read them in ``tpflex_trainer.hooks.config``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tpflex_trainer.launch.devices import LocalGpu


@dataclass(frozen=True)
class RankSetting:
    """What every rank of this node shares."""

    controller: tuple[str, ...]
    job: str
    job_spec: str  # absolute path
    node: str
    store: str
    isolate_gpus: bool = False
    tls: Mapping[str, str] = field(default_factory=dict)  # TPFLEX_TLS_* -> path or name
    credential_file: str = ""  # the job credential's file (TPFLEX_JOB_CREDENTIAL_FILE)


def rank_env(base: Mapping[str, str], s: RankSetting, gpu: LocalGpu, local_rank: int,
             local_world: int, restarts: int) -> dict[str, str]:
    env = dict(base)
    env.update({
        "TPFLEX_CONTROLLER": ",".join(s.controller),
        "TPFLEX_JOB": s.job,
        "TPFLEX_JOB_SPEC": s.job_spec,
        "TPFLEX_NODE": s.node,
        "TPFLEX_GPU": str(gpu.index),
        "TPFLEX_GPU_UUID": gpu.uuid,
        "TPFLEX_STORE": s.store,
        "TPFLEX_LOCAL_RANK": str(local_rank),
        "TPFLEX_RESTART_COUNT": str(restarts),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # CUDA's device order = NVML's
    })
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # not torchrun's world
        env.pop(name, None)
    if s.isolate_gpus:  # the rank sees only its GPU, as cuda:0
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid or str(gpu.index)
        env["TPFLEX_CUDA_DEVICE"] = "0"
    else:
        env["TPFLEX_CUDA_DEVICE"] = str(cuda_device_for(gpu, base.get("CUDA_VISIBLE_DEVICES")))
    env.update({k: v for k, v in s.tls.items() if v})
    env.pop("TPFLEX_JOB_CREDENTIAL_FILE", None)
    env.pop("TPFLEX_REGISTER_TOKEN_FILE", None)  # the admin token stays with tpflex-run
    if s.credential_file:
        env["TPFLEX_JOB_CREDENTIAL_FILE"] = s.credential_file
    env.setdefault("OMP_NUM_THREADS", "1")
    # an NCCL error or an abort cleans the communicator up without ending the process: the
    # hooks re-form the groups in-process (docs/launch.md "On each kind of failure")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    return env


def cuda_device_for(gpu: LocalGpu, visible: str | None) -> int:
    """The CUDA index of ``gpu`` under an inherited ``CUDA_VISIBLE_DEVICES`` (Slurm's
    ``--gres``, a container runtime): its position in that list, by index or UUID; the NVML
    index itself when the variable is unset. ValueError when the list leaves it out."""
    if visible is None or not visible.strip():
        return gpu.index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    for position, entry in enumerate(entries):
        if entry == str(gpu.index) or (gpu.uuid and entry == gpu.uuid):
            return position
    raise ValueError(f"CUDA_VISIBLE_DEVICES={visible} does not include GPU {gpu.index}"
                     f"{' (' + gpu.uuid + ')' if gpu.uuid else ''}")
