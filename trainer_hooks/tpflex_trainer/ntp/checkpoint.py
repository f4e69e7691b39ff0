"""Layout-independent checkpoints: one payload per (family, unit), loadable into any
layout. The members of one replica each write the units they hold (the replica holds
every unit once); ``meta.json``, written last, marks the checkpoint complete."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tpflex_trainer.ntp.config import REPLICATED
from tpflex_trainer.ntp.errors import CheckpointError, CheckpointMismatchError
from tpflex_trainer.ntp.layout import MemberLayout
from tpflex_trainer.ntp.state import LocalState, unit_payload

FORMAT_VERSION = 1
META = "meta.json"


def _key(family: str, unit: int) -> str:
    return f"{family}:{unit}"


def member_file(member: MemberLayout) -> str:
    m = member.member
    stage = f"-k{m.stage}" if m.stage else ""
    return f"units-r{m.replica}{stage}-s{m.slot}.pt"


def write_member_units(path: Path, member: MemberLayout, state: LocalState, specs, family_key=None) -> str:
    """Write the payloads of every unit ``member`` holds (replicated ones only on TP rank
    0); returns the file name. ``family_key(family)``: the family's name in the
    checkpoint (pipeline stages qualify it with the stage)."""
    path.mkdir(parents=True, exist_ok=True)
    name_of = family_key or (lambda fam: fam)
    payloads = {
        _key(name_of(fam), u): unit_payload(state, specs, fam, u).cpu()
        for fam, units in state.units.items()
        if fam != REPLICATED or member.tp_rank == 0
        for u in units
    }
    name = member_file(member)
    tmp = path / (name + ".tmp")
    torch.save(payloads, tmp)
    os.replace(tmp, path / name)
    return name


def write_meta(path: Path, fingerprint: dict, step: int, files: list[str]) -> None:
    """``fingerprint``: the model adapter's fields a loading model must match (a
    ``GPTConfig`` is accepted too)."""
    if hasattr(fingerprint, "to_dict"):
        fingerprint = fingerprint.to_dict()
    meta = {"format": FORMAT_VERSION, "config": fingerprint, "step": step, "files": files}
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path / META)


class CheckpointReader:
    """Validates a checkpoint against a model fingerprint (``ModelAdapter.fingerprint()``;
    a ``GPTConfig`` is accepted too) on construction (no collectives)."""

    def __init__(self, path: str | os.PathLike, fingerprint) -> None:
        if hasattr(fingerprint, "to_dict"):
            fingerprint = fingerprint.to_dict()
        self.path = Path(path)
        try:
            meta = json.loads((self.path / META).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no complete checkpoint at {self.path} ({META} missing)") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"unreadable checkpoint meta at {self.path}: {exc}") from None
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointMismatchError("format", FORMAT_VERSION, meta.get("format"))
        found = meta.get("config", {})
        for field, expected in fingerprint.items():
            if found.get(field) != expected:
                raise CheckpointMismatchError(field, expected, found.get(field))
        # stages qualify the unit names: a one-stage model (no such field) needs 1 too
        stages = (fingerprint.get("pipeline_stages", 1), found.get("pipeline_stages", 1))
        if stages[0] != stages[1]:
            raise CheckpointMismatchError("pipeline_stages", *stages)
        self.step = int(meta["step"])
        self._files = list(meta["files"])
        self._index: dict[str, torch.Tensor] | None = None

    def _load(self) -> dict[str, torch.Tensor]:
        if self._index is None:
            index: dict[str, torch.Tensor] = {}
            for name in self._files:
                try:
                    index.update(torch.load(self.path / name, weights_only=True, mmap=True))
                except (OSError, RuntimeError) as exc:
                    raise CheckpointError(f"unreadable checkpoint file {self.path / name}: {exc}") from None
            self._index = index
        return self._index

    def payload(self, family: str, unit: int) -> torch.Tensor:
        try:
            return self._load()[_key(family, unit)]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path} lacks unit {unit} of {family!r}") from None
