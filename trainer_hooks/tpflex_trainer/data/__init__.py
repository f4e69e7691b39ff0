"""Training data for the user's loop (docs/loop.md, "Data"): a deterministic,
resumable global sampler (``sampler``) and token sources (``sources``) it indexes."""

from tpflex_trainer.data.sampler import GlobalSampler, SamplerError
from tpflex_trainer.data.sources import (
    DataError,
    MegatronIndexed,
    TokenArray,
    open_tokens,
)

__all__ = ["DataError", "GlobalSampler", "MegatronIndexed", "SamplerError", "TokenArray", "open_tokens"]
