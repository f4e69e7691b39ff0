"""Weights in and out in the user's format: Hugging Face safetensors directories.

``SafetensorsReader`` reads one member's unit rows with safetensors slices
(``safe_open(...).get_slice(name)[rows]``), never a whole file; ``write_hf_dir`` writes
config.json + model.safetensors (or shards + ``model.safetensors.index.json`` above
``max_shard_bytes``) that ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from tpflex_trainer.ntp.config import ParamSpec, to_user
from tpflex_trainer.ntp.errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def has_weights(path: str | os.PathLike) -> bool:
    return (Path(path) / SINGLE).is_file() or (Path(path) / INDEX).is_file()


def _runs(units: tuple[int, ...]) -> list[tuple[int, int]]:
    """Consecutive unit ids merged: [(first, count)]."""
    runs: list[tuple[int, int]] = []
    for u in units:
        if runs and runs[-1][0] + runs[-1][1] == u:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((u, 1))
    return runs


class SafetensorsReader:
    """``rename``: stored key -> the model's parameter name (transformers' checkpoint key
    renamings, GPT-NeoX's ``embed_out`` -> ``lm_head``: ``checkpoint_renamer``)."""

    def __init__(self, path: str | os.PathLike, rename: Callable[[str], str] | None = None) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            weight_map = None
        else:
            raise CheckpointError(f"no {SINGLE} or {INDEX} in {self.path}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self.handles = {f: safe_open(str(self.path / f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = dict.fromkeys(self.handles[SINGLE].keys(), SINGLE)
        self.weight_map = weight_map
        self.stored = {k: k for k in weight_map}
        if rename is not None:
            self.stored = {rename(k): k for k in weight_map}
        self.bytes_read = 0

    def _slice(self, name: str):
        if name not in self.stored:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        key = self.stored[name]
        return self.handles[self.weight_map[key]].get_slice(key)

    def rows(self, spec: ParamSpec, units: tuple[int, ...]) -> torch.Tensor:
        """The canonical (unit-major) rows of ``units`` of ``spec``, fp32; a replicated
        parameter whole."""
        sl = self._slice(spec.name)
        shape = tuple(sl.get_shape())
        if shape != spec.user_shape:
            raise CheckpointError(f"{spec.name}: shape {shape} in {self.path}, the model has {spec.user_shape}")
        if not spec.sharded:
            out = sl[:]
        else:
            pieces = []
            starts = [spec.n_units * sum(spec.chunk_rows[:c]) for c in range(len(spec.chunk_rows))]
            for first, count in _runs(units):
                if spec.chunk_rows:  # each unit's rows of every chunk, unit-major (config.to_canonical)
                    parts = [sl[s0 + first * r:s0 + (first + count) * r].reshape(count, r, *spec.shape[1:])
                             for s0, r in zip(starts, spec.chunk_rows, strict=True)]
                    pieces.append(torch.cat(parts, 1).reshape(count * spec.unit_rows, *spec.shape[1:]))
                    continue
                a, b = first * spec.unit_rows, (first + count) * spec.unit_rows
                pieces.append(sl[:, a:b].t() if spec.transposed else sl[a:b])
            out = torch.cat(pieces) if pieces else torch.empty((0, *spec.shape[1:]))
        self.bytes_read += out.numel() * out.element_size()
        return out.to(torch.float32).contiguous()


def checkpoint_renamer(model) -> Callable[[str], str]:
    """Stored safetensors key -> the model's parameter name, by transformers' own checkpoint
    conversion mapping for ``model`` (key renamings such as GPT-NeoX's ``embed_out.`` ->
    ``lm_head.``). A key that a weight *converter* would rewrite (tensors merged or split on
    load) is refused: tpflex reads a member's rows straight from the file."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        name, converted = rename_source_key(key, renamings, converters)
        if converted is not None:
            raise CheckpointError(f"{key}: transformers converts this checkpoint tensor on load ({converted}); "
                                  "tpflex reads the stored rows as they are: save the model with this "
                                  "transformers (save_pretrained) first")
        return name

    return rename


def model_dtype(config) -> torch.dtype:
    """The dtype the user's model is stored in (``config.dtype``, which ``save_pretrained``
    records from the weights); fp32 when the config names no floating-point dtype."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def write_hf_dir(path: str | os.PathLike, config, tensors: Mapping[str, torch.Tensor],
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` (HF names, user layout; the runtime's fp32 master weights) in the
    model's own dtype (``model_dtype``: a bf16 model is exported as bf16) and the config,
    which names that dtype; ``config`` itself is not changed. Returns the files."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = model_dtype(config)
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(str(path))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name in sorted(tensors):
        t = tensors[name].to(dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE), metadata=meta)
        return ["config.json", SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(path / name), metadata=meta)
        weight_map.update({k: name for k in shard})
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return ["config.json", *names, INDEX]


def write_member_part(path: Path, specs: list[ParamSpec], units: Mapping[str, tuple[int, ...]],
                      params: Mapping[str, torch.Tensor]) -> None:
    """One member's parameters (unit-major) and the units it holds, for ``assemble``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {s.name: params[s.name].detach().cpu().contiguous() for s in specs}
    meta = {"units": json.dumps({f: list(u) for f, u in units.items()})}
    save_file(tensors, str(path), metadata=meta)


def assemble(specs: list[ParamSpec], parts: list[Path]) -> dict[str, torch.Tensor]:
    """Whole tensors in the user's layout (HF names and shapes) from the members' parts
    of one replica (every unit appears at least once; copies of a replicated unit are
    identical)."""
    from safetensors import safe_open

    full = {s.name: torch.empty(s.shape, dtype=torch.float32) for s in specs}
    seen = {s.name: set() for s in specs}
    for part in parts:
        with safe_open(str(part), framework="pt") as f:
            units = json.loads(f.metadata()["units"])
            for s in specs:
                local = f.get_tensor(s.name)
                if not s.sharded:
                    full[s.name].copy_(local)
                    seen[s.name].add(0)
                    continue
                for pos, u in enumerate(units[s.family]):
                    rows = slice(pos * s.unit_rows, (pos + 1) * s.unit_rows)
                    full[s.name][u * s.unit_rows:(u + 1) * s.unit_rows] = local[rows]
                    seen[s.name].add(u)
    for s in specs:
        if len(seen[s.name]) != (s.n_units if s.sharded else 1):
            raise CheckpointError(f"export: units of {s.name} missing from the parts")
    return {s.name: to_user(s, full[s.name]) for s in specs}
