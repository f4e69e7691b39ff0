#!/usr/bin/env python3
"""Write a tpflex job spec (protobuf JSON) for the nodes of a Slurm allocation.

One data-parallel replica per NVLink domain. On HGX nodes a domain is one node (its
GPUs 0..N-1); on NVL72 racks pass --nodes-per-domain so that consecutive nodes of the
allocation form one domain. The rack names must be the ones the nodes' agents register
(``[agent] rack``, or derived from the NVLink fabric): --rack-pattern formats them from
the first node of each domain ({node}) and the domain index ({domain}).

    make-job-spec.py --name llm-7b --nodes "$(scontrol show hostnames "$SLURM_JOB_NODELIST")" \\
        --gpus-per-node 8 --units heads=32,kv_groups=8,ffn=64,vocab=64 --local-batch 16 > job.json

Needs only tpflex-proto (installed with tpflex-trainer). Bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import sys

from google.protobuf import json_format
from tpflex_proto import types_pb2


def _units(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"want NAME=COUNT[,NAME=COUNT...], got {part!r}")
        out[name.strip()] = int(count)
    return out


def build(name: str, nodes: list[str], gpus_per_node: int, nodes_per_domain: int, rack_pattern: str,
          units: dict[str, int], local_batch: int, policy: str) -> types_pb2.JobSpec:
    if len(nodes) % nodes_per_domain:
        raise ValueError(f"--nodes: {len(nodes)} nodes do not split into domains of {nodes_per_domain}")
    tp = gpus_per_node * nodes_per_domain
    replicas = len(nodes) // nodes_per_domain
    spec = types_pb2.JobSpec(name=name, base_tp=tp, min_tp=1, policy=policy, local_batch=local_batch,
                             global_batch=local_batch * replicas)
    for d in range(replicas):
        members = nodes[d * nodes_per_domain:(d + 1) * nodes_per_domain]
        rack = rack_pattern.format(node=members[0], domain=d)
        spec.replicas.add().stages.add(rack=rack, ranks=[
            types_pb2.GpuRef(node=n, index=g) for n in members for g in range(gpus_per_node)])
    for family, count in units.items():
        spec.units.add(name=family, count=count)
    return spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make-job-spec.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="job name")
    p.add_argument("--nodes", required=True, help="node names, separated by white space or commas")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes-per-domain", type=int, default=1, help="nodes per NVLink domain (NVL72: 18)")
    p.add_argument("--rack-pattern", default="{node}", help="rack name of a domain ({node}, {domain})")
    p.add_argument("--units", type=_units, required=True, help="unit families NAME=COUNT,...")
    p.add_argument("--local-batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--policy", default="ntp-pw", choices=["ntp-pw", "ntp", "dp-drop", "spare"])
    ns = p.parse_args(argv)
    nodes = ns.nodes.replace(",", " ").split()
    try:
        if not nodes:
            raise ValueError("--nodes: no node names")
        if ns.gpus_per_node < 1 or ns.nodes_per_domain < 1 or ns.local_batch < 1:
            raise ValueError("--gpus-per-node, --nodes-per-domain and --local-batch must be >= 1")
        spec = build(ns.name, nodes, ns.gpus_per_node, ns.nodes_per_domain, ns.rack_pattern,
                     ns.units, ns.local_batch, ns.policy)
    except (ValueError, KeyError, IndexError) as exc:
        print(f"make-job-spec.py: error: {exc}", file=sys.stderr)
        return 2
    print(json_format.MessageToJson(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
