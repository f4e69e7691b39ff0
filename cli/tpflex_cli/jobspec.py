"""``tpflexctl job-spec``: a job spec whose unit families and counts come from the model.

    tpflexctl job-spec --model /models/llama-3-8b --name llm-8b \\
        --nodes "$(scontrol show hostnames "$SLURM_JOB_NODELIST")" --gpus-per-node 8 > job.json

Reads the Hugging Face model directory's config.json (no weights) and derives the units
exactly as the trainers' adapter does (``tpflex_trainer.ntp.model_units``: the model on the
meta device, so it needs tpflex-trainer with torch and transformers where it runs,
imported only by this command; tpflex-cli alone has no protobuf either, which the trainer
package brings); the spec records them, with the config's digest and the
base TP they were derived at, in its ``model`` block, against which the controller checks
the spec's units at RegisterJob and PUT /v1/jobs/{job}/spec. The same command as
``deploy/slurm/make-job-spec.py --model``; no controller is contacted. Exit 2, with the
reason and nothing printed, for a model the adapter refuses (MoE, ...) or a bad argument.
"""

from __future__ import annotations

import argparse
import sys

from tpflex_proto import jobspec

COMMAND = "job-spec"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(COMMAND, help="print a job spec with the units derived from a HF model directory",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (its config.json)")
    jobspec.add_arguments(p)
    p.add_argument("--no-self-test", action="store_true",
                   help="skip the adapter's fidelity self-test on a miniature of the model")
    return p


PROG = "tpflexctl job-spec"


def _needs_trainer(exc: ImportError) -> str:
    return (f"--model: job-spec needs tpflex-trainer (torch, transformers, protobuf) where it runs "
            f"({exc}); run it on a training node, or deploy/slurm/make-job-spec.py there")


def _load_derive():
    try:
        from tpflex_trainer.ntp.model_units import derive  # torch, transformers: only here
    except ImportError as exc:
        raise ValueError(_needs_trainer(exc)) from None
    return derive


def run(args: argparse.Namespace) -> int:
    # tpflex-cli installs tpflex-proto without protobuf (tpflex-proto[rpc]), which building
    # a spec needs; the trainer package brings it. Said before anything else is attempted.
    try:
        from tpflex_proto import types_pb2  # noqa: F401
    except ImportError as exc:
        print(f"{PROG}: error: {_needs_trainer(exc)}", file=sys.stderr)
        return 2
    return jobspec.run(args, PROG, _load_derive)
