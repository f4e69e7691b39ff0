"""A model's unit families and counts, as its adapter derives them: the one derivation
that ``tpflexctl job-spec`` / ``deploy/slurm/make-job-spec.py`` write into a job spec and
that the trainers send the controller when they register (``TpflexHooks.start``).

:func:`derive` builds the Hugging Face model's adapter itself (``HfAdapter``: the model on
the meta device, ``hf_plan.analyse``, the fidelity self-test), so a spec carries exactly
the counts the trainers will use, and a model the adapter refuses (MoE, no ``base_model_tp_plan``, ...) is
refused here with the adapter's reason. No weights are read.
"""

from __future__ import annotations

import os
from pathlib import Path

from tpflex_proto import jobspec, types_pb2

from tpflex_trainer.ntp.errors import NtpError

GPT_MODEL_TYPE = "tpflex-gpt"  # the built-in GPTConfig model (the demo's)


class ModelRefused(ValueError):
    """A model directory the trainer's adapter would refuse; the message says why."""


def of_adapter(adapter, base_tp: int, config: dict | None = None) -> types_pb2.ModelUnits:
    """What ``adapter`` (a whole-model adapter) says: its primary unit families (the
    ones a job spec lists; derived families such as replicated ``kv`` follow from them)."""
    from tpflex_trainer.ntp.adapter import GPTAdapter

    if isinstance(adapter, GPTAdapter):
        model_type, config = GPT_MODEL_TYPE, config if config is not None else adapter.cfg.to_dict()
    else:
        model_type = str(getattr(getattr(adapter, "config", None), "model_type", "") or "")
    return types_pb2.ModelUnits(
        model_type=model_type, base_tp=base_tp,
        config_sha256=jobspec.config_digest(config) if config is not None else "",
        units=[types_pb2.UnitFamily(name=f, count=int(n)) for f, n in adapter.unit_counts.items()])


def of_runtime_model(model, adapter, base_tp: int) -> types_pb2.ModelUnits:
    """What a trainer sends at registration: ``model`` is what it gave ``NtpRuntime`` (a
    ``GPTConfig``, an adapter or a model directory), ``adapter`` the runtime's whole-model
    adapter."""
    config = None
    if isinstance(model, (str, os.PathLike)):
        try:
            config = jobspec.read_config(model)
        except ValueError:
            config = None
    return of_adapter(adapter, base_tp, config)


def derive(model_dir: str | os.PathLike, base_tp: int, pp: int = 1, self_test: bool = True) -> types_pb2.ModelUnits:
    """The units of the Hugging Face model in ``model_dir`` (its config.json) at base TP
    ``base_tp`` with ``pp`` pipeline stages; :class:`ModelRefused` with the reason for a
    directory that is no model, or a model the adapter (or the pipeline split) refuses."""
    config_dict = jobspec.read_config(model_dir)  # ValueError with the path's trouble
    if base_tp < 1 or pp < 1:
        raise ModelRefused(f"base TP {base_tp} and pipeline stages {pp} must be >= 1")
    try:
        from tpflex_trainer.ntp.hf_adapter import HfAdapter, load_config
        from tpflex_trainer.ntp.stage_adapter import stage_view

        config = load_config(Path(model_dir))
        adapter = HfAdapter(config, base_tp, self_test=self_test)
        for k in range(pp):
            stage_view(adapter, k, pp)
    except NtpError as exc:
        raise ModelRefused(f"the trainer's adapter refuses {model_dir}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - AutoConfig: an unknown model_type, a bad field, ...
        raise ModelRefused(f"transformers cannot load {model_dir}: {type(exc).__name__}: {exc}") from None
    return of_adapter(adapter, base_tp, config_dict)
