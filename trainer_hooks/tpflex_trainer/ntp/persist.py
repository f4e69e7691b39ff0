"""Writing a running job's state out: layout-independent checkpoints and the Hugging Face
export. Both are collective over the active members of every stage; the first replica of
each stage writes its members' parts, and one member (stage 0, TP rank 0 of that replica)
completes the checkpoint or assembles the model."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tpflex_trainer.ntp import checkpoint as ckpt
from tpflex_trainer.ntp.errors import PlanError


def stage_key(stage: int, n_stages: int, family: str) -> str:
    """A family's name across the job: stages have families of the same names (every
    stage has attention heads) but different parameters."""
    return family if n_stages == 1 else f"stage{stage}.{family}"


def _barrier(rt) -> None:
    """Over every active member of every stage (nothing for a lone member)."""
    group = rt.groups.active if rt.groups.active is not None else rt.groups.tp
    if group is not None:
        dist.barrier(group=group)


def save_checkpoint(rt, path: Path) -> None:
    if rt.layout is None:
        raise PlanError("no layout yet: call start() first")
    writers = rt.layout.replicas[0]
    mine = rt.layout.member(rt.me)
    k, n = rt.me.stage, rt.n_stages
    writing = mine is not None and rt.me.replica == writers.replica
    if writing and rt.state is not None:
        ckpt.write_member_units(path, mine, rt.state, rt.specs, lambda fam: stage_key(k, n, fam))
    _barrier(rt)
    if writing and mine.tp_rank == 0 and k == 0:
        files = [ckpt.member_file(m) for lay in rt.stage_layouts for m in lay.replicas[0].members]
        ckpt.write_meta(path, rt.adapter.fingerprint(), rt.step, files)
    _barrier(rt)


def export_hf(rt, path: Path, max_shard_bytes: int | None = None) -> list[str]:
    """config.json + safetensors; each stage's tensors assembled from its parts."""
    from tpflex_trainer.ntp import hf_io

    config = getattr(rt.adapter, "config", None)
    if rt.layout is None or config is None:
        raise PlanError("export_hf needs a started runtime over a Hugging Face model")
    scratch = path / ".tpflex-export"
    writers = rt.layout.replicas[0]
    mine = rt.layout.member(rt.me)
    writing = mine is not None and rt.me.replica == writers.replica and rt.state is not None

    def part(m) -> Path:
        return scratch / f"part-k{m.stage}-s{m.slot}.safetensors"

    if writing:
        hf_io.write_member_part(part(rt.me), rt.specs, rt.state.units, rt.state.tensors["param"])
    _barrier(rt)
    files: list[str] = []
    if writing and mine.tp_rank == 0 and rt.me.stage == 0:
        tensors, parts = {}, []
        for k, lay in enumerate(rt.stage_layouts):
            stage_parts = [part(m.member) for m in lay.replicas[0].members]
            tensors.update(hf_io.assemble(rt.stage_adapters[k].specs, stage_parts))
            parts += stage_parts
        files = hf_io.write_hf_dir(path, config, tensors, max_shard_bytes or hf_io.DEFAULT_MAX_SHARD_BYTES)
        for p in parts:
            p.unlink()
        scratch.rmdir()
    _barrier(rt)
    return files
