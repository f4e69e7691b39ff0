#!/usr/bin/env python3
"""Write a tpflex job spec (protobuf JSON) for the nodes of a Slurm allocation.

One data-parallel replica per NVLink domain. On HGX nodes a domain is one node (its
GPUs 0..N-1); on NVL72 racks pass --nodes-per-domain so that consecutive nodes of the
allocation form one domain. The rack names must be the ones the nodes' agents register
(``[agent] rack``, or derived from the NVLink fabric): --rack-pattern formats them from
the first node of each domain ({node}) and the domain index ({domain}).

    make-job-spec.py --name llm-7b --nodes "$(scontrol show hostnames "$SLURM_JOB_NODELIST")" \\
        --gpus-per-node 8 --units heads=32,kv_groups=8,ffn=64,vocab=64 --local-batch 16 > job.json

Needs only tpflex-proto (installed with tpflex-trainer). Bad arguments exit 2 with a
message naming the argument: node, rack and job names must be the ones the control plane
accepts (a compressed Slurm list such as ``node[01-04]`` must be expanded first), each node
once, each unit family once, at most 1024 GPUs per node.
"""

from __future__ import annotations

import argparse
import re
import string
import sys

from google.protobuf import json_format
from tpflex_proto import keys, types_pb2

MAX_GPUS_PER_NODE = 1024  # tpflex-run's bound on NVML indices (0..1023)
_NAME_RULE = "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"


def _units(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"want NAME=COUNT[,NAME=COUNT...], got {part!r}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"unit family {name.strip()!r} given twice")
        out[name.strip()] = int(count)
    return out


def _check_nodes(nodes: list[str]) -> None:
    for n in nodes:
        if not keys.name_ok(n):
            hint = (" (a compressed Slurm node list? expand it: "
                    "--nodes \"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\")\")") if set(n) & set("[]") else ""
            raise ValueError(f"--nodes: node name {n!r} must be {_NAME_RULE}{hint}")
    seen: set[str] = set()
    for n in nodes:
        if n in seen:
            raise ValueError(f"--nodes: node {n!r} is given twice (a GPU is one rank of one replica)")
        seen.add(n)


def _rack(pattern: str, node: str, domain: int) -> str:
    """``pattern`` with {node} and {domain} (and format specs such as {domain:02d});
    ValueError naming --rack-pattern for anything else, before formatting anything big."""
    try:
        for _, field, spec, conversion in string.Formatter().parse(pattern):
            if field is None:
                continue
            if field not in ("node", "domain") or conversion not in (None, "s", "r") or "{" in (spec or ""):
                raise ValueError(f"only {{node}} and {{domain}} may be used, got {{{field}}}")
            if any(int(w) > 63 for w in re.findall(r"\d+", spec or "")):
                raise ValueError(f"format spec {spec!r} is too wide for a rack name")
        rack = pattern.format(node=node, domain=domain)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--rack-pattern: cannot use {pattern!r}: {exc}") from None
    if not keys.name_ok(rack):
        raise ValueError(f"--rack-pattern: rack name {rack!r} must be {_NAME_RULE}")
    return rack


def build(name: str, nodes: list[str], gpus_per_node: int, nodes_per_domain: int, rack_pattern: str,
          units: dict[str, int], local_batch: int, policy: str) -> types_pb2.JobSpec:
    if not keys.job_name_ok(name):
        raise ValueError(f"--name: job name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    if not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE:  # before anything is built
        raise ValueError(f"--gpus-per-node: {gpus_per_node} is not within 1..{MAX_GPUS_PER_NODE}")
    _check_nodes(nodes)
    if len(nodes) % nodes_per_domain:
        raise ValueError(f"--nodes: {len(nodes)} nodes do not split into domains of {nodes_per_domain}")
    tp = gpus_per_node * nodes_per_domain
    replicas = len(nodes) // nodes_per_domain
    try:
        spec = types_pb2.JobSpec(name=name, base_tp=tp, min_tp=1, policy=policy, local_batch=local_batch,
                                 global_batch=local_batch * replicas)
    except ValueError as exc:  # out of the field's range
        raise ValueError(f"--local-batch: {exc}") from None
    for d in range(replicas):
        members = nodes[d * nodes_per_domain:(d + 1) * nodes_per_domain]
        rack = _rack(rack_pattern, members[0], d)
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
        if ns.gpus_per_node > MAX_GPUS_PER_NODE:
            raise ValueError(f"--gpus-per-node: {ns.gpus_per_node} is not within 1..{MAX_GPUS_PER_NODE}")
        spec = build(ns.name, nodes, ns.gpus_per_node, ns.nodes_per_domain, ns.rack_pattern,
                     ns.units, ns.local_batch, ns.policy)
    except (ValueError, KeyError, IndexError) as exc:
        print(f"make-job-spec.py: error: {exc}", file=sys.stderr)
        return 2
    print(json_format.MessageToJson(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
