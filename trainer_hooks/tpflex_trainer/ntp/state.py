"""A member's training state (weights + Adam moments, unit-major) and its per-unit form.

The per-unit *payload* of (family, unit) is the flat concatenation, over the family's
parameters in spec order and over ``KINDS``, of that unit's row block. Resharding and
checkpoints move payloads; which member holds a unit is decided by the layout.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tpflex_trainer.ntp.config import REPLICATED, ParamSpec

KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class LocalState:
    units: dict[str, tuple[int, ...]]  # family -> sorted units held; REPLICATED -> (0,)
    tensors: dict[str, dict[str, torch.Tensor]]  # kind -> param name -> local tensor
    step: int


def member_units(units: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A layout member's units plus the replicated pseudo-unit every active member holds."""
    return {**{f: tuple(u) for f, u in units.items()}, REPLICATED: (0,)}


def full_init(spec: ParamSpec, seed: int) -> torch.Tensor:
    """The canonical initial value of a parameter: a function of (seed, name) only, so
    every layout (and the single-process reference) starts from the same model."""
    if spec.init_std == 0.0:
        return torch.full(spec.shape, spec.init_const, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=gen, dtype=torch.float32) * spec.init_std


def _rows(spec: ParamSpec, position: int) -> slice:
    return slice(position * spec.unit_rows, (position + 1) * spec.unit_rows)


def init_local_state(
    specs: list[ParamSpec],
    units: Mapping[str, tuple[int, ...]],
    seed: int,
    device: torch.device,
    initial: Callable[[ParamSpec, tuple[int, ...]], torch.Tensor] | None = None,
) -> LocalState:
    """Step-0 state: ``initial(spec, held units)`` gives the member's rows (default: the
    seeded ``full_init``); Adam moments are zero."""
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    for spec in specs:
        held = units[spec.family]
        if initial is not None:
            local = initial(spec, tuple(held)).to(torch.float32)
        else:
            full = full_init(spec, seed)
            local = torch.cat([full[_rows(spec, u)] for u in held]) if held else full[:0]
        tensors["param"][spec.name] = local.to(device).contiguous()
        tensors["exp_avg"][spec.name] = torch.zeros_like(tensors["param"][spec.name])
        tensors["exp_avg_sq"][spec.name] = torch.zeros_like(tensors["param"][spec.name])
    return LocalState(dict(units), tensors, 0)


def unit_payload(state: LocalState, specs: list[ParamSpec], family: str, unit: int) -> torch.Tensor:
    pos = state.units[family].index(unit)
    parts = [
        state.tensors[kind][s.name][_rows(s, pos)].reshape(-1)
        for s in specs
        if s.family == family
        for kind in KINDS
    ]
    return torch.cat(parts)


def payload_numel(specs: list[ParamSpec], family: str) -> int:
    return len(KINDS) * sum(s.unit_numel for s in specs if s.family == family)


def build_state(
    specs: list[ParamSpec],
    units: Mapping[str, tuple[int, ...]],
    step: int,
    device: torch.device,
    fetch: Callable[[str, int], torch.Tensor],
) -> LocalState:
    """Assemble a state holding ``units`` from per-unit payloads given by ``fetch``."""
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    for spec in specs:
        n = len(units[spec.family])
        for kind in KINDS:
            tensors[kind][spec.name] = torch.empty(
                (n * spec.unit_rows, *spec.shape[1:]), dtype=torch.float32, device=device
            )
    for family, held in units.items():
        fam_specs = [s for s in specs if s.family == family]
        for pos, unit in enumerate(held):
            payload = fetch(family, unit)
            offset = 0
            for s in fam_specs:
                for kind in KINDS:
                    chunk = payload[offset : offset + s.unit_numel]
                    tensors[kind][s.name][_rows(s, pos)].copy_(chunk.view(s.unit_rows, *s.shape[1:]))
                    offset += s.unit_numel
    return LocalState(dict(units), tensors, step)


def state_digest(state: LocalState) -> str:
    """A digest of ``state``: its step, units and every tensor's bits (two states with the
    same digest are the same bit for bit; a soak compares rounds with its replay). Pure."""
    h = hashlib.sha256(repr((state.step, sorted(state.units.items()))).encode())
    for kind in sorted(state.tensors):
        for name in sorted(state.tensors[kind]):
            t = state.tensors[kind][name].detach().to("cpu").contiguous()
            h.update(f"{kind}/{name}/{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
