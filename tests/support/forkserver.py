"""The test session's one forkserver, with everything its children would import.

``multiprocessing`` keeps one forkserver per process, started by the first ``Process``
of the ``forkserver`` context; ``set_forkserver_preload`` only matters until then. In a
whole-suite run that first process comes from an early test (tests/launch), so the
preload list of whichever module set it last is what every later child forks from:
without transformers in it, each worker of ``tpflex-train`` (tests/trainer, HF models)
imported transformers and its model family again after the fork, seconds of CPU per
process. One list here, the union of what the harness, the rendezvous test and
``tpflex-train``'s launcher preload, makes the order of the tests irrelevant.
(``tpflex-train``'s ``Launcher`` sets its own list when it starts the server first, e.g.
a trainer test file run alone; that list is a subset of this one.)
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext

# the model families the HF tests build (tests/trainer/hf_support.make_model_dir)
HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PRELOAD = ["torch", "torch.distributed", "tpflex_trainer.ntp.runtime", "tpflex_trainer.train.worker",
           "tpflex_trainer.ntp.hf_adapter",
           *(f"transformers.models.{f}.modeling_{f}" for f in HF_FAMILIES)]


def context() -> ForkServerContext:
    """The forkserver context, its preload list set to ``PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
