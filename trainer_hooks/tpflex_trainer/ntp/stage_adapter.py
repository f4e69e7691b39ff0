"""One pipeline stage of a model adapter: the adapter the runtime uses for a member of
stage k. Its parameters are the stage's (its layers; the embedding on the first stage, the
final norm and output layer on the last), its families are the families of those
parameters, and ``build`` gives the stage's module. With one stage it is the adapter
itself (the whole model): PP 1 is a one-stage pipeline of the same runtime."""

from __future__ import annotations

from typing import Any

from tpflex_trainer.ntp.adapter import ModelAdapter
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.stages import layer_ranges, stage_of


class StageAdapter(ModelAdapter):
    def __init__(self, base: ModelAdapter, stage: int, n_stages: int) -> None:
        layer_ranges(base.n_layers, n_stages)  # LayoutError when the layers cannot fill the stages
        if base.tied:
            raise UnsupportedModelError(
                "tied input and output embeddings cannot be split over pipeline stages "
                "(the embedding is on the first stage, the output layer on the last)")
        fidelity = getattr(base, "fidelity", None)
        if fidelity is not None and fidelity.pipeline:
            raise UnsupportedModelError(f"pipeline stages: the model failed the fidelity self-test split over "
                                        f"stages: {fidelity.pipeline}", code="self_test_failed")
        self.base, self.stage, self.n_stages = base, stage, n_stages
        self.specs = [s for s in base.specs if stage_of(base.place_of(s.name), base.n_layers, n_stages) == stage]
        families = {s.family for s in self.specs}
        self.unit_counts = {f: n for f, n in base.unit_counts.items() if f in families}
        self.derived = {f: d for f, d in base.derived.items() if f in families}
        self.vocab, self.n_layers, self.hidden = base.vocab, base.n_layers, base.hidden
        self.config = getattr(base, "config", None)

    def fingerprint(self) -> dict[str, Any]:
        return {**self.base.fingerprint(), "pipeline_stages": self.n_stages}

    def initial_local(self, spec, units, seed):
        return self.base.initial_local(spec, units, seed)

    def build(self, units, tensors, group):
        return self.base.build_stage(units, tensors, group, self.stage, self.n_stages)


def stage_view(adapter: ModelAdapter, stage: int, n_stages: int) -> ModelAdapter:
    """The adapter of ``stage`` (the adapter itself when there is one stage)."""
    if n_stages == 1:
        return adapter
    return StageAdapter(adapter, stage, n_stages)
