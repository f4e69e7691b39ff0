"""The Kubernetes manifests of deploy/kubernetes/ as Python objects, and lookups across
them (pods of workloads, volume sources, mounts)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.deploy.tools import DEPLOY

KUBE = DEPLOY / "kubernetes"
K8S_VERSION = "1.33"
WORKLOADS = ("Deployment", "DaemonSet", "Job", "StatefulSet")


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(KUBE.glob("*.yaml")):
        out.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return out


@dataclass(frozen=True)
class Objects:
    docs: tuple[dict, ...]

    @classmethod
    def load(cls) -> Objects:
        return cls(tuple(doc for _, doc in manifests()))

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in WORKLOADS]

    def keys_of(self, source: dict) -> set[str]:
        """Keys a configMap/secret volume source (or projected source) provides."""
        if "configMap" in source:
            obj = self.get("ConfigMap", source["configMap"]["name"])
        else:
            ref = source["secret"]
            obj = self.get("Secret", ref.get("secretName") or ref["name"])
        keys = set(obj.get("data") or {}) | set(obj.get("stringData") or {})
        items = (source.get("configMap") or source.get("secret")).get("items")
        return {i["path"] for i in items} if items else keys

    def mounted_files(self, workload: dict, container: dict) -> set[str]:
        """Every file path a container sees through its configMap/secret/projected mounts."""
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        files = set()
        for m in container.get("volumeMounts", []):
            v = volumes.get(m["name"])
            if v is None:  # a StatefulSet's volumeClaimTemplate: a volume, not files we know
                assert m["name"] in {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
                continue
            sources = v["projected"]["sources"] if "projected" in v else [v]
            for s in sources:
                if "configMap" in s or "secret" in s:
                    files |= {f"{m['mountPath']}/{k}" for k in self.keys_of(s)}
        return files


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: dict, name: str | None = None) -> dict:
    cs = pod_spec(workload)["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def env_of(c: dict, placeholders: dict[str, str]) -> dict[str, str]:
    """The container's environment with fieldRef values replaced by ``placeholders`` and
    $(VAR) references expanded as the kubelet does."""
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "valueFrom" in e:
            out[e["name"]] = placeholders[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
    return out


def toml_of(objects: Objects, configmap: str, key: str) -> dict:
    return tomllib.loads(objects.get("ConfigMap", configmap)["data"][key])


def port_number(c: dict, name_or_number) -> int | None:
    if isinstance(name_or_number, int):
        return name_or_number
    return next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == name_or_number), None)
