"""The fidelity self-test: before a Hugging Face model trains under NTP, a miniature of the
user's own config (the same class and every field that is not a size; tiny sizes) runs
through the NTP path (its members as threads of this process, ``local_group``) and
through HF's module, and the losses and every parameter's gradient are compared, over a
few SGD steps. A mismatch refuses the model (``UnsupportedModelError`` naming the module
where the gradients start to differ), turning the next family's quirk into a refusal
instead of a silently wrong run.

Layouts checked: KV-group units at a degree that splits them unevenly (3 groups on 2
members), query-head units above the KV heads (replicated KV units) when the model has
grouped heads, and two pipeline stages at degree 1. A pipeline mismatch does not refuse
the model; it refuses pipeline stages only (``SelfTestResult.pipeline``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpflex_trainer.ntp import dropout
from tpflex_trainer.ntp.config import REPLICATED, to_canonical
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.hf_miniature import BATCH, SEQ, VOCAB, miniature_config
from tpflex_trainer.ntp.hf_plan import ATTN, attention_heads
from tpflex_trainer.ntp.layout import derived_units
from tpflex_trainer.ntp.local_group import local_groups, run_members
from tpflex_trainer.ntp.stages import stage_of

log = logging.getLogger(__name__)

SKIP_ENV = "TPFLEX_SKIP_SELF_TEST"
PASSED_ENV = "TPFLEX_SELF_TEST_PASSED"  # set by tpflex-train for its workers (``passed_token``)
LOSS_TOL = 1e-5  # relative
GRAD_TOL = 1e-4  # relative L2 per parameter (fp32 sums in another order: ~1e-7 seen)
STEPS = 2
MAX_MINIATURE_PARAMS = 2_000_000  # the decoder miniatures have about 0.1 M
SGD_LR = 0.5


@dataclass(frozen=True)
class SelfTestResult:
    tensor_parallel: str | None  # None: exact; else why not
    pipeline: str | None
    layouts: tuple[str, ...]


_CACHE: dict[str, SelfTestResult] = {}
_LOCK = threading.Lock()


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def _reference(config, seed: int):
    from tpflex_trainer.ntp.hf_adapter import keyed_reference, lm_from_config

    torch.manual_seed(seed)
    model = lm_from_config(config, dtype=torch.float32)
    with torch.no_grad():  # off the init's symmetries (unit norms, zero biases, a zero padding row)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.train()
    keyed_reference(model)  # its masks keyed as the NTP path's (seed 0, the step, the samples)
    return model


def _batch(config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad < VOCAB:
        tokens[:, ::4] = pad  # the padding row is looked up
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _assign(n: int, degree: int) -> list[tuple[int, ...]]:
    """Balanced contiguous units, the larger shares last (3 units on 2 members: 1, 2)."""
    base, extra = divmod(n, degree)
    sizes = [base + (1 if m >= degree - extra else 0) for m in range(degree)]
    out, start = [], 0
    for s in sizes:
        out.append(tuple(range(start, start + s)))
        start += s
    return out


def _member_units(adapter, degree: int) -> list[dict[str, tuple[int, ...]]]:
    per = {fam: _assign(n, degree) for fam, n in adapter.unit_counts.items()}
    members = [{fam: per[fam][m] for fam in per} for m in range(degree)]
    for m in members:
        for fam, d in adapter.derived.items():
            m[fam] = derived_units(m[d.source], d.per_unit)
    return members


def _canon(spec, tensor: torch.Tensor) -> torch.Tensor:
    return to_canonical(spec, tensor)


def _local(spec, full: torch.Tensor, units: tuple[int, ...]) -> torch.Tensor:
    if not spec.sharded:
        return full.clone()
    r = spec.unit_rows
    return torch.cat([full[u * r:(u + 1) * r] for u in units]).clone() if units else full[:0].clone()


def _ntp_grads(adapter, state: dict, batch, degree: int, stages: int = 1,
               step: int = 0) -> tuple[float, dict, list[str]]:
    """Loss, full canonical gradients, the replicated parameters whose gradients differ
    across members, and member 0's module outputs (one stage only), for the NTP path at
    ``degree`` (threads) with ``stages`` stages."""
    tokens, targets = batch
    members = _member_units(adapter, degree)
    groups = local_groups(degree)
    full = {s.name: _canon(s, state[s.name]) for s in adapter.specs}

    # built here, one after another: building swaps nn.Module.register_parameter for the
    # meta-device build (``parameters_on_meta``), which must not race another thread
    built = []
    for rank in range(degree):
        units = members[rank]
        tensors = {s.name: _local(s, full[s.name], units.get(s.family, ())) for s in adapter.specs}
        if stages == 1:
            built.append([adapter.build(units, tensors, groups[rank])])
        else:
            where = {s.name: stage_of(adapter.place_of(s.name), adapter.n_layers, stages) for s in adapter.specs}
            built.append([adapter.build_stage(units, {n: t for n, t in tensors.items() if where[n] == k},
                                              groups[rank], k, stages) for k in range(stages)])

    acts: dict[str, torch.Tensor] = {}
    hooks = _record_outputs(built[0][0].lm, acts) if stages == 1 else []

    def run(rank: int):
        mods = built[rank]
        with mods[0].dropout_scope(0, step, 0, tokens.shape[0]):
            if stages == 1:
                loss = mods[0].loss(tokens, targets)
            else:
                x = tokens
                for mod in mods[:-1]:
                    x = mod.forward_stage(x)
                loss = mods[-1].stage_loss(x, targets)
        loss.backward()
        grads = {}
        for mod in mods:
            grads.update({s.name: p.grad for s, p in mod.params_in_spec_order()})
        return float(loss.detach()), grads

    try:
        results = run_members(groups, run)
    finally:
        for h in hooks:
            h.remove()
    grads, split = {}, []
    for s in adapter.specs:
        got = [g[s.name] for _, g in results]
        if any(x is None for x in got):
            got = [torch.zeros_like(_local(s, full[s.name], members[m].get(s.family, ())))
                   if x is None else x for m, x in enumerate(got)]
        if not s.sharded:
            if s.partial_grad:
                grads[s.name] = sum(got[1:], got[0].clone())
            else:
                grads[s.name] = got[0]
                if any(not torch.allclose(x, got[0], rtol=1e-6, atol=1e-9) for x in got[1:]):
                    split.append(s.name)
            continue
        grads[s.name] = full_grad(s, full[s.name], members, got)
    return results[0][0], grads, split, acts


def full_grad(spec, full: torch.Tensor, members: list[dict[str, tuple[int, ...]]],
              got: list[torch.Tensor]) -> torch.Tensor:
    """A sharded parameter's full canonical gradient from the members' local ones
    (``got[m]``: member m's rows of its units, in unit order)."""
    out = torch.zeros_like(full)
    r = spec.unit_rows
    for m, g in enumerate(got):
        for pos, u in enumerate(members[m].get(spec.family, ())):
            out[u * r:(u + 1) * r] += g[pos * r:(pos + 1) * r]
    return out


def _record_outputs(module, into: dict[str, torch.Tensor]) -> list:
    """Forward hooks keeping each submodule's (first) output tensor by path, in the order
    the modules finish."""
    def hook(path):
        def fn(_mod, _args, out):
            t = out[0] if isinstance(out, tuple) and out else getattr(out, "logits", out)
            if isinstance(t, torch.Tensor) and path not in into:
                into[path] = t.detach()
        return fn

    return [m.register_forward_hook(hook(path)) for path, m in module.named_modules() if path]


def _first_output_difference(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str | None:
    """The first module (in HF's order of completion) whose output the NTP path gives in
    full (a replicated activation, same shape) and differs from HF's."""
    for path, w in want.items():
        g = got.get(path)
        if g is not None and g.shape == w.shape and _rel(g, w) > GRAD_TOL:
            return path
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.float().norm())
    return float((a.float() - b.float()).norm()) / (den if den > 0 else 1.0)


def _compare(adapter, model, layouts: list[tuple[str, int, int]]) -> str | None:
    """Train the reference ``STEPS`` SGD steps; at each, every layout's loss and gradients
    against HF's. None when all agree, else the first disagreement."""
    order = [s.name for s in adapter.specs]
    specs = {s.name: s for s in adapter.specs}
    for step in range(STEPS):
        batch = _batch(model.config, 1000 + step)
        model.zero_grad(set_to_none=True)
        hf_acts: dict[str, torch.Tensor] = {}
        hooks = _record_outputs(model, hf_acts)
        try:
            with dropout.scope(0, step, 0, batch[0].shape[0], int(model.config.hidden_size)):
                logits = model(input_ids=batch[0], use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[1].reshape(-1))
        loss.backward()
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            return (f"{len(frozen)} frozen parameters (requires_grad=False: {', '.join(frozen[:3])}"
                    f"{', ...' if len(frozen) > 3 else ''}): NTP trains every parameter")
        unused = [n for n, p in model.named_parameters() if p.grad is None]
        if unused:
            # torch's AdamW skips a parameter without a gradient; the NTP optimizer gives every
            # parameter one (zeros) and would decay it: its weights would drift from HF's training
            return (f"step {step}: {len(unused)} parameters get no gradient from a token-only forward "
                    f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}: another modality's "
                    "encoder?); NTP's AdamW would still decay them, where torch's skips them")
        state = {k: v.detach() for k, v in model.state_dict().items()}
        want = {n: p.grad for n, p in model.named_parameters()}
        for label, degree, stages in layouts:
            got_loss, got, split, acts = _ntp_grads(adapter, state, batch, degree, stages, step)
            where = f"step {step}, {label}"
            bad = [n for n in order if _rel(got[n], _canon(specs[n], want[n])) > GRAD_TOL]
            if bad:
                first = _first_output_difference(hf_acts, acts)
                if first is not None:
                    module, how = first, "the forward differs first at the output of"
                else:
                    module, how = bad[-1].rsplit(".", 1)[0], "gradients differ from HF's starting (going back " \
                        "from the loss) at"
                return (f"{where}: {how} module {module} ({len(bad)} of {len(order)} parameters' gradients "
                        f"differ: {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}); "
                        f"loss {got_loss:.6g} vs HF {float(loss.detach()):.6g}")
            if abs(got_loss - float(loss.detach())) > LOSS_TOL * abs(float(loss.detach())):
                return f"{where}: loss {got_loss:.6g} vs HF {float(loss.detach()):.6g}"
            if split:
                return f"{where}: replicated parameters' gradients differ across TP members: {split[:4]}"
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(SGD_LR * p.grad)
    return None


def _key(config) -> str:
    return f"{type(config).__module__}.{type(config).__qualname__}:{config.to_json_string()}"


def passed_token(config, result: SelfTestResult, head_units: bool) -> str:
    """What a launcher that ran the self-test hands its workers in ``PASSED_ENV``: the
    result, bound to a digest of the exact config, so each rank does not run it again."""
    digest = hashlib.sha256(f"{_key(config)}|head_units={head_units}".encode()).hexdigest()
    return json.dumps({"config_sha256": digest, "pipeline": result.pipeline, "layouts": list(result.layouts)})


def _inherited(key: str) -> SelfTestResult | None:
    try:
        got = json.loads(os.environ.get(PASSED_ENV, "") or "null")
        if isinstance(got, dict) and got.get("config_sha256") == hashlib.sha256(key.encode()).hexdigest():
            return SelfTestResult(None, got.get("pipeline"), tuple(got.get("layouts") or ()))
    except ValueError:
        log.warning("ntp ignoring %s: not JSON", PASSED_ENV)
    return None


def self_test(config, adapter_cls, head_units: bool = False) -> SelfTestResult:
    """Run (once per process, config and unit kind) the self-test of ``config``'s model
    class; a result handed down by the launcher for this exact config (``PASSED_ENV``) is
    taken."""
    key = f"{_key(config)}|head_units={head_units}"
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        result = _inherited(key) or _self_test(config, adapter_cls, head_units)
        _CACHE[key] = result
        return result


def _self_test(config, adapter_cls, head_units: bool) -> SelfTestResult:
    """Layouts: KV-group units split unevenly (4 KV groups on 3 members; 3 on 2; or 2 on
    2) for a job whose base TP degree is at most the KV heads, else query-head units above
    the KV heads (2 KV heads, 4 query heads on 3 members: replicated KV units); then 2
    pipeline stages."""
    try:
        minis = [miniature_config(config, 2 if head_units else 4), miniature_config(config, 2)]
        from tpflex_trainer.ntp.hf_adapter import build_meta_model

        size = max(sum(p.numel() for p in build_meta_model(mini).parameters()) for mini in minis)
    except Exception as exc:  # noqa: BLE001 - any failure to build the miniature refuses, with its reason
        why = f"no miniature of the config could be built ({type(exc).__name__}: {exc})"
        return SelfTestResult(why, why, ())
    if size > MAX_MINIATURE_PARAMS:
        why = (f"its miniature still has {size:,} parameters (above {MAX_MINIATURE_PARAMS:,}): parts of the model "
               "that the miniature's sizes do not shrink (an encoder of another modality?) were not checked")
        return SelfTestResult(why, why, ())
    a_heads, a_kv = attention_heads(minis[0])
    if not head_units:
        degree = 3 if a_kv >= 3 else 2
        layouts = [(f"TP {degree} over {a_kv} KV groups", minis[0], degree, degree)]
    elif a_heads > a_kv:
        layouts = [(f"TP {a_kv + 1} above {a_kv} KV heads", minis[0], a_kv + 1, a_kv + 1)]
    else:
        layouts = []
    b = minis[1]
    tp_why, pp_why, names = None, None, []
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the members are threads already
    try:
        for label, mini, degree, base_tp in layouts:
            names.append(label)
            tp_why = _guarded(_compare_layout, adapter_cls, mini, label, degree, 1, base_tp)
            if tp_why:
                break
        if b.num_hidden_layers >= 2 and not getattr(b, "tie_word_embeddings", False):
            names.append("2 pipeline stages")
            pp_why = _guarded(_compare_layout, adapter_cls, b, "2 pipeline stages", 1, 2, 1)
    finally:
        torch.set_num_threads(torch_threads)
    return SelfTestResult(tp_why, pp_why, tuple(names))


def _compare_layout(adapter_cls, mini, label: str, degree: int, stages: int, base_tp: int) -> str | None:
    adapter = adapter_cls(mini, base_tp, self_test=False)
    if degree > min(adapter.unit_counts.values()):
        return None
    return _compare(adapter, _reference(mini, 0), [(label, degree, stages)])


def _guarded(fn, *args) -> str | None:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - whatever breaks the NTP path refuses it, with the reason
        return f"the NTP path failed on a miniature of the model ({type(exc).__name__}: {exc})"


def check(config, adapter_cls, head_units: bool = False) -> SelfTestResult | None:
    """The self-test, or None with a loud warning when ``TPFLEX_SKIP_SELF_TEST`` is set.
    ``UnsupportedModelError`` when the model does not train exactly under NTP."""
    if skipped():
        log.warning("ntp FIDELITY SELF-TEST SKIPPED (%s is set): %s is trained under NTP without checking that "
                    "its sharded forward and backward equal HF's; a mismatch would train silently wrong",
                    SKIP_ENV, type(config).__name__)
        return None
    result = self_test(config, adapter_cls, head_units)
    if result.tensor_parallel:
        raise UnsupportedModelError(f"{type(config).__name__} failed the fidelity self-test (a miniature of the "
                                    f"config under NTP against HF's own module): {result.tensor_parallel}",
                                    code="self_test_failed")
    return result


__all__ = ["SelfTestResult", "check", "miniature_config", "self_test", "SKIP_ENV", "ATTN", "REPLICATED"]
