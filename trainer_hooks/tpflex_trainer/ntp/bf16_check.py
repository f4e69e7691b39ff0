"""bf16 training against the fp32 reference (issue 34): a family's miniature (the fidelity
self-test's ``miniature_config``, 4 KV groups) trained a few AdamW steps two ways, on the
same batches, from the same weights:

* the reference: HF's own module in fp32, in this process (``hf_selftest._reference``,
  HF's forward, cross-entropy over its logits, ``torch.optim.AdamW``);
* NTP in bf16 as the runtime trains with ``TrainSettings(dtype="bf16")``: mixed precision
  by ``torch.autocast("cpu", dtype=torch.bfloat16)`` around each member's forward (what
  ``PipelineStep`` does: matmuls, attention and the TP collectives of their outputs in
  bf16; HF's norms and the vocab-parallel cross-entropy upcast to fp32), the backward
  outside it; fp32 master weights, gradients and Adam state. The members run as threads
  (``local_group``) at a nonuniform layout the self-test checks (``layout_of``: 3 members
  over 4 KV groups, 1, 1 and 2 of them; or 3 members above 2 KV heads, query-head units),
  built once; each step their parameters are refreshed from the fp32 masters, their
  gradients assembled into full canonical gradients (sharded rows placed, partial
  replicated gradients summed), and the masters updated by the runtime's own AdamW
  (``optim.adam_step``, weight decay on parameters of 2+ dimensions, as the reference's
  parameter groups).

``compare`` returns both loss curves; the test asserts every step within 1 % relative.
Which families: ``exact_families`` reads the coverage section of docs/models.md, which is
``hf_coverage.markdown(hf_coverage.coverage())`` (tests/trainer/test_hf_coverage.py keeps
them equal); running ``coverage()`` itself would run the self-test of all ~116 families.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tpflex_trainer.ntp import dropout, hf_coverage
from tpflex_trainer.ntp.hf_miniature import miniature_config
from tpflex_trainer.ntp.hf_plan import attention_heads
from tpflex_trainer.ntp.hf_selftest import (
    _batch,
    _canon,
    _local,
    _member_units,
    _reference,
    full_grad,
)
from tpflex_trainer.ntp.local_group import local_groups, run_members
from tpflex_trainer.ntp.optim import AdamSettings, adam_step
from tpflex_trainer.ntp.state import LocalState

DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"
STEPS = 4
ADAM = AdamSettings(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOSS_TOL = 0.01  # relative, per step


@dataclass(frozen=True)
class Bf16Result:
    model_type: str
    layout: str
    reference: tuple[float, ...]  # fp32 HF, per step
    ntp: tuple[float, ...]  # NTP members under bf16 autocast (or fp32 with bf16=False), per step

    @property
    def rel(self) -> tuple[float, ...]:
        return tuple(abs(b - r) / abs(r) for r, b in zip(self.reference, self.ntp, strict=True))

    @property
    def max_rel(self) -> float:
        return max(self.rel)


def exact_families(doc: Path = DOC) -> list[str]:
    """Model types of the dense families the coverage table marks exact."""
    out = []
    for line in hf_coverage.section(doc).splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.split("|")[1:5]]  # type, class, experts, status
        if cells[2] == "no" and cells[3] == "exact":
            out.append(cells[0].strip("`"))
    return out


def family_config(model_type: str):
    """The family's default config as the coverage table builds it (the causal LM class's
    own config class: a composite model type's text config)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return hf_coverage._causal_lm_config(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type],
                                         AutoConfig.for_model(model_type))


def _adamw(model) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ADAM.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps)


def reference_losses(mini, steps: int = STEPS, bf16: bool = False, model=None) -> list[float]:
    """HF's module (``_reference(mini, 0)`` unless given) trained ``steps`` AdamW steps in
    one process (fp32, or under bf16 autocast for a diagnosis: what HF's own bf16 gives)."""
    model = _reference(mini, 0) if model is None else model
    opt = _adamw(model)
    losses = []
    for step in range(steps):
        tokens, targets = _batch(mini, 1000 + step)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                dropout.scope(0, step, 0, tokens.shape[0], int(mini.hidden_size)):
            logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def ntp_losses(adapter, mini, degree: int, steps: int = STEPS, bf16: bool = True, init=None) -> list[float]:
    """The NTP members (threads) trained ``steps`` steps from the reference's initial
    weights (``init``, its state dict; ``_reference(mini, 0)``'s unless given): bf16
    autocast forwards, fp32 masters and AdamW (see the module's docstring)."""
    if init is None:
        init = _reference(mini, 0).state_dict()
    init = {k: v.detach() for k, v in init.items()}
    specs = list(adapter.specs)
    masters = {s.name: _canon(s, init[s.name]).clone() for s in specs}
    state = LocalState(units={}, step=0, tensors={
        "param": masters,
        "exp_avg": {n: torch.zeros_like(t) for n, t in masters.items()},
        "exp_avg_sq": {n: torch.zeros_like(t) for n, t in masters.items()},
    })
    decay = {s.name: len(s.shape) >= 2 for s in specs}
    members = _member_units(adapter, degree)
    groups = local_groups(degree)
    built = [adapter.build(members[r], {s.name: _local(s, masters[s.name], members[r].get(s.family, ()))
                                        for s in specs}, groups[r]) for r in range(degree)]
    losses = []
    for step in range(steps):
        tokens, targets = _batch(mini, 1000 + step)

        def run(rank: int, step=step, tokens=tokens, targets=targets):
            mod = built[rank]
            with torch.no_grad():
                for s, p in mod.params_in_spec_order():
                    p.copy_(_local(s, masters[s.name], members[rank].get(s.family, ())))
                    p.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                    mod.dropout_scope(0, step, 0, tokens.shape[0]):
                loss = mod.loss(tokens, targets).float()
            loss.backward()
            return float(loss.detach()), {s.name: p.grad for s, p in mod.params_in_spec_order()}

        results = run_members(groups, run)
        grads = {}
        for s in specs:
            got = [g[s.name] for _, g in results]
            got = [torch.zeros_like(_local(s, masters[s.name], members[m].get(s.family, ()))) if x is None
                   else x.float() for m, x in enumerate(got)]
            if not s.sharded:
                grads[s.name] = sum(got[1:], got[0].clone()) if s.partial_grad else got[0]
                continue
            grads[s.name] = full_grad(s, masters[s.name], members, got)
        adam_step(state, grads, ADAM, decay=decay)
        losses.append(results[0][0])
    return losses


def layout_of(mini) -> tuple[int, str]:
    """A nonuniform layout the self-test checks: 3 members over 4 KV groups (1, 1, 2); a
    model with 2 KV heads (and more query heads): 3 members above them, query-head units
    (4 heads: 1, 1, 2; the KV heads replicated), the coverage table's "TP 3 above 2 KV
    heads"; else 2 members over its KV groups."""
    heads, kv = attention_heads(mini)
    if kv >= 3:
        return 3, f"TP 3 over {kv} KV groups"
    if heads > kv:
        return kv + 1, f"TP {kv + 1} above {kv} KV heads"
    return 2, f"TP 2 over {kv} KV groups"


def compare(model_type: str, steps: int = STEPS, bf16: bool = True) -> Bf16Result:
    """fp32 reference against NTP (bf16 autocast by default) for one family's miniature."""
    from transformers.utils import logging as hf_logging

    from tpflex_trainer.ntp.hf_adapter import HfAdapter

    hf_logging.set_verbosity_error()
    mini = miniature_config(family_config(model_type))
    degree, label = layout_of(mini)
    adapter = HfAdapter(mini, degree, self_test=False)
    if degree > min(adapter.unit_counts.values()):  # fewer units of a family than members
        degree = min(adapter.unit_counts.values())
        label = f"TP {degree} (fewer units than the layout's members)"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the members are threads already
    try:
        model = _reference(mini, 0)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ref = reference_losses(mini, steps, model=model)
        got = ntp_losses(adapter, mini, degree, steps, bf16, init=init)
    finally:
        torch.set_num_threads(threads)
    return Bf16Result(model_type, label, tuple(ref), tuple(got))


__all__ = ["Bf16Result", "compare", "exact_families", "family_config", "ntp_losses", "reference_losses",
           "LOSS_TOL", "STEPS"]
