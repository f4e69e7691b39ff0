#!/usr/bin/env python3
"""Write a tpflex job spec (protobuf JSON) for the nodes of a Slurm allocation.

One data-parallel replica per NVLink domain (per --pp consecutive domains with pipeline
stages). On HGX nodes a domain is one node (its GPUs 0..N-1); on NVL72 racks pass
--nodes-per-domain so that consecutive nodes of the allocation form one domain. The rack
names must be the ones the nodes' agents register (``[agent] rack``, or derived from the
NVLink fabric): --rack-pattern formats them from the first node of each domain ({node})
and the domain index ({domain}).

    make-job-spec.py --name llm-7b --nodes "$(scontrol show hostnames "$SLURM_JOB_NODELIST")" \\
        --gpus-per-node 8 --model /models/llama-3-8b --local-batch 16 > job.json

--model DIR derives the unit families and counts from the Hugging Face model directory's
config.json exactly as the trainers' adapter does (tpflex_trainer.ntp.model_units; needs
tpflex-trainer, no weights are read) and records them with the config's digest in the
spec's ``model`` block, which the controller checks the units against; a model the adapter
refuses (MoE, ...) exits 2 with the reason. --units NAME=COUNT,... types them by hand
(needs only tpflex-proto). ``tpflexctl job-spec`` is the same command. Bad arguments exit
2 with a message naming the argument: node, rack and job names must be the ones the
control plane accepts (a compressed Slurm list such as ``node[01-04]`` must be expanded
first), each node once, each unit family once, at most 1024 GPUs per node.
"""

from __future__ import annotations

import argparse
import sys

from tpflex_proto import jobspec


def _load_derive():
    try:
        from tpflex_trainer.ntp.model_units import derive
    except ImportError as exc:
        raise ValueError(f"--model needs tpflex-trainer (torch, transformers) installed ({exc}); "
                         "or type the units with --units") from None
    return derive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make-job-spec.py", description=__doc__.split("\n\n")[0])
    jobspec.add_arguments(p)
    units = p.add_mutually_exclusive_group(required=True)
    units.add_argument("--model", help="Hugging Face model directory: units from its config.json")
    units.add_argument("--units", type=jobspec.parse_units, help="unit families NAME=COUNT,... by hand")
    p.add_argument("--no-self-test", action="store_true",
                   help="with --model: skip the adapter's fidelity self-test on a miniature")
    return jobspec.run(p.parse_args(argv), "make-job-spec.py", _load_derive)


if __name__ == "__main__":
    sys.exit(main())
