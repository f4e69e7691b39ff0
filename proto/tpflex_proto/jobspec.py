"""Job specs for the nodes of an allocation, and what a model says about their units.

Pure (protobuf and the standard library; no torch): ``deploy/slurm/make-job-spec.py``,
``tpflexctl job-spec`` and the controller's checks use it. Importing it imports no
protobuf (tpflexctl, whose distribution has none, imports it): :func:`build` and
:func:`render` import the generated types and ``json_format`` when they are called. The unit counts themselves come
from the trainer's model adapter (``tpflex_trainer.ntp.model_units``), the only place
they are derived; this module carries them (:class:`types_pb2.ModelUnits`) and compares
them with a spec's units (:func:`contradictions`).

Layout: one domain per ``nodes_per_domain`` consecutive nodes (an HGX node, or the nodes
of an NVL72 rack), ``pp`` consecutive domains per replica (its pipeline stages in order).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import string
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tpflex_proto import keys

if TYPE_CHECKING:  # the generated code needs protobuf (tpflex-proto[rpc]): imported where used
    from tpflex_proto import types_pb2

MAX_GPUS_PER_NODE = 1024  # tpflex-run's bound on NVML indices (0..1023)
NAME_RULE = "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
POLICIES = ("ntp-pw", "ntp", "dp-drop", "spare")
FORMATS = ("proto", "rest")


# ---- what the model says ----


def config_digest(config: Mapping) -> str:
    """sha256 of a config.json's content as canonical JSON (key order and white space do
    not count)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_config(model_dir: str | Path) -> dict:
    """A Hugging Face model directory's config.json as a dict; ValueError naming the
    path and what is wrong with it."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{model_dir} is not a directory")
    file = path / "config.json"
    try:
        text = file.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{model_dir} is not a Hugging Face model directory (no config.json)") from None
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file} is not UTF-8 text (byte {exc.start})") from None
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{file} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def unit_counts(units: Iterable[types_pb2.UnitFamily]) -> dict[str, int]:
    return {u.name: int(u.count) for u in units}


def contradictions(spec_units: Mapping[str, int], model_units: Mapping[str, int],
                   source: str = "model config") -> list[str]:
    """Each unit family on which a spec and a model disagree, one sentence each, in
    family order: ``unit family 'attn': spec says 8, model config says 4``."""
    out = []
    for family in sorted(set(spec_units) | set(model_units)):
        said = spec_units.get(family)
        model = model_units.get(family)
        if said == model:
            continue
        spec_part = f"spec says {said}" if said is not None else "spec has no such family"
        model_part = f"{source} says {model}" if model is not None else f"{source} has no such family"
        out.append(f"unit family {family!r}: {spec_part}, {model_part}")
    return out


def model_contradictions(spec: types_pb2.JobSpec) -> list[str]:
    """What the spec's own ``model`` block (if any) contradicts in it: its units, and the
    base TP degree they were derived at (the counts depend on it)."""
    if not spec.HasField("model"):
        return []
    m = spec.model
    out = []
    if m.base_tp != spec.base_tp:
        out.append(f"base_tp: spec says {spec.base_tp}, the model's units were derived at base TP "
                   f"{m.base_tp} (unit counts depend on it: derive them again at {spec.base_tp})")
    return out + contradictions(unit_counts(spec.units), unit_counts(m.units))


def describe(model: types_pb2.ModelUnits) -> str:
    digest = f", config sha256 {model.config_sha256[:12]}" if model.config_sha256 else ""
    return f"{model.model_type or 'unknown'}{digest}, base TP {model.base_tp}"


# ---- specs for an allocation ----


def _check_nodes(nodes: list[str]) -> None:
    if not nodes:
        raise ValueError("--nodes: no node names")
    for n in nodes:
        if not keys.name_ok(n):
            hint = (" (a compressed Slurm node list? expand it: "
                    "--nodes \"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\")\")") if set(n) & set("[]") else ""
            raise ValueError(f"--nodes: node name {n!r} must be {NAME_RULE}{hint}")
    seen: set[str] = set()
    for n in nodes:
        if n in seen:
            raise ValueError(f"--nodes: node {n!r} is given twice (a GPU is one rank of one replica)")
        seen.add(n)


def rack_name(pattern: str, node: str, domain: int) -> str:
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
        raise ValueError(f"--rack-pattern: rack name {rack!r} must be {NAME_RULE}")
    return rack


def build(name: str, nodes: list[str], gpus_per_node: int, nodes_per_domain: int, rack_pattern: str,
          units: Mapping[str, int], local_batch: int, policy: str, *, pp: int = 1, min_tp: int = 1,
          model: types_pb2.ModelUnits | None = None) -> types_pb2.JobSpec:
    """The spec; ValueError naming the argument that is wrong."""
    if not keys.job_name_ok(name):
        raise ValueError(f"--name: job name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    if not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE:  # before anything is built
        raise ValueError(f"--gpus-per-node: {gpus_per_node} is not within 1..{MAX_GPUS_PER_NODE}")
    if nodes_per_domain < 1 or local_batch < 1 or pp < 1 or min_tp < 1:
        raise ValueError("--nodes-per-domain, --local-batch, --pp and --min-tp must be >= 1")
    _check_nodes(nodes)
    if len(nodes) % nodes_per_domain:
        raise ValueError(f"--nodes: {len(nodes)} nodes do not split into domains of {nodes_per_domain}")
    domains = len(nodes) // nodes_per_domain
    if domains % pp:
        raise ValueError(f"--pp: {domains} domains do not split into replicas of {pp} stages")
    tp = gpus_per_node * nodes_per_domain
    if min_tp > tp:
        raise ValueError(f"--min-tp: {min_tp} is above the base TP degree {tp}")
    replicas = domains // pp
    from tpflex_proto import types_pb2  # protobuf: only where a spec is built

    try:
        spec = types_pb2.JobSpec(name=name, base_tp=tp, min_tp=min_tp, policy=policy, local_batch=local_batch,
                                 global_batch=local_batch * replicas)
    except ValueError as exc:  # out of the field's range
        raise ValueError(f"--local-batch: {exc}") from None
    for r in range(replicas):
        rep = spec.replicas.add()
        for k in range(pp):
            d = r * pp + k
            members = nodes[d * nodes_per_domain:(d + 1) * nodes_per_domain]
            rep.stages.add(rack=rack_name(rack_pattern, members[0], d), ranks=[
                types_pb2.GpuRef(node=n, index=g) for n in members for g in range(gpus_per_node)])
    for family, count in units.items():
        spec.units.add(name=family, count=count)
    if model is not None:
        spec.model.CopyFrom(model)
    return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The allocation's arguments, shared by make-job-spec.py and ``tpflexctl job-spec``."""
    p.add_argument("--name", required=True, help="job name")
    p.add_argument("--nodes", required=True, help="node names, separated by white space or commas")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes-per-domain", type=int, default=1, help="nodes per NVLink domain (NVL72: 18)")
    p.add_argument("--rack-pattern", default="{node}", help="rack name of a domain ({node}, {domain})")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica (consecutive domains)")
    p.add_argument("--local-batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--min-tp", type=int, default=1, help="the smallest TP degree a replica may run at")
    p.add_argument("--policy", default="ntp-pw", choices=POLICIES)
    p.add_argument("--format", default="proto", choices=FORMATS,
                   help="proto: the trainers' TPFLEX_JOB_SPEC file (protobuf JSON, registered by "
                        "RegisterJob); rest: the body of PUT /v1/jobs/{job}/spec (tpflexctl set-spec)")


def base_tp_of(ns: argparse.Namespace) -> int:
    return ns.gpus_per_node * ns.nodes_per_domain


def from_args(ns: argparse.Namespace, units: Mapping[str, int],
              model: types_pb2.ModelUnits | None = None) -> types_pb2.JobSpec:
    nodes = ns.nodes.replace(",", " ").split()
    return build(ns.name, nodes, ns.gpus_per_node, ns.nodes_per_domain, ns.rack_pattern, units,
                 ns.local_batch, ns.policy, pp=ns.pp, min_tp=ns.min_tp, model=model)


def render(spec: types_pb2.JobSpec, fmt: str = "proto") -> str:
    """``proto``: protobuf JSON (camelCase, what ``load_spec`` and RegisterJob take);
    ``rest``: the REST body of PUT /v1/jobs/{job}/spec (snake_case, no name)."""
    from google.protobuf import json_format

    if fmt == "proto":
        return json_format.MessageToJson(spec)
    body = json_format.MessageToDict(spec, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    body.pop("name", None)
    body.pop("created_at", None)
    for u in [*body.get("units", []), *body.get("model", {}).get("units", [])]:
        u["bytes_per_unit"] = int(u["bytes_per_unit"])  # a uint64: a string in protobuf JSON
    return json.dumps(body, indent=2)


def parse_units(text: str) -> dict[str, int]:
    """``NAME=COUNT[,NAME=COUNT...]`` (argparse type)."""
    out = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"want NAME=COUNT[,NAME=COUNT...], got {part!r}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"unit family {name.strip()!r} given twice")
        out[name.strip()] = int(count)
    return out


Derive = Callable[..., "types_pb2.ModelUnits"]


def run(ns: argparse.Namespace, prog: str, load_derive: Callable[[], Derive]) -> int:
    """Print the spec ``ns`` asks for (``ns.model``: units derived from the model directory
    by the trainer's adapter, which ``load_derive`` imports; else ``ns.units``). Exit 2
    with a message naming the argument, and nothing printed, for anything wrong."""
    try:
        from_args(ns, {"units": 1})  # the allocation first: cheap, and before any model is built
        model = None
        units = getattr(ns, "units", None) or {}
        if getattr(ns, "model", None):
            try:
                read_config(ns.model)  # a bad path fails before torch is imported
            except ValueError as exc:
                raise ValueError(f"--model: {exc}") from None
            derive = load_derive()
            try:
                model = derive(ns.model, base_tp_of(ns), ns.pp, self_test=not ns.no_self_test)
            except ValueError as exc:
                raise ValueError(f"--model: {exc}") from None
            units = unit_counts(model.units)
        spec = from_args(ns, units, model)
    except (ValueError, KeyError, IndexError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(render(spec, ns.format))
    return 0
