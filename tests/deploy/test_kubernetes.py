"""deploy/kubernetes/: every manifest passes the Kubernetes schema (kubernetes-validate,
strict: unknown fields are errors), and the objects agree with each other and with the
programs: images and versions, ports and probes, Service selectors, the configuration
each service loads (its own settings loader), the environment names the programs read,
the files they are told to open, and tpflex-run's arguments."""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
from tpflex_agent.settings import load_settings as agent_settings
from tpflex_controller.settings import load_settings as controller_settings
from tpflex_trainer.hooks.config import load_spec
from tpflex_trainer.launch import cli

from tests.deploy.kube import (
    K8S_VERSION,
    KUBE,
    Objects,
    container,
    env_of,
    manifests,
    pod_labels,
    pod_spec,
    port_number,
    toml_of,
)
from tests.deploy.tools import REPO, SECRET_FILES

FIELDS = {"metadata.name": "tpflex-controller-7d9f-abcde", "spec.nodeName": "gpu-node-01",
          "status.podIP": "10.1.2.3"}
OBJ = Objects.load()


@pytest.mark.parametrize("path, doc", manifests(), ids=lambda x: x.name if isinstance(x, Path) else
                         f"{x['kind']}/{x['metadata']['name']}")
def test_every_manifest_passes_the_strict_schema(path, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_misplaced_field_and_a_wrong_type():
    bad = copy.deepcopy(OBJ.get("DaemonSet", "tpflex-agent"))
    pod_spec(bad)["containers"][0]["capability"] = ["SYS_ADMIN"]  # belongs in securityContext
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(OBJ.get("Deployment", "tpflex-controller"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _version(component: str) -> str:
    """The release a component's tree describes: versions come from git tags through
    setuptools-scm, whose ``fallback_version`` names the release line for untagged trees."""
    meta = tomllib.loads((REPO / component / "pyproject.toml").read_text())
    assert "version" in meta["project"].get("dynamic", []), component
    return meta["tool"]["setuptools_scm"]["fallback_version"]


def test_images_are_the_components_at_their_package_versions():
    images = {c["image"] for w in OBJ.workloads() for c in pod_spec(w)["containers"]}
    ours = {i for i in images if i.startswith("tpflex/")}
    assert ours == {f"tpflex/controller:{_version('controller')}", f"tpflex/agent:{_version('agent')}",
                    f"tpflex/trainer:{_version('trainer_hooks')}"}
    for image in images - ours:  # third-party images at an exact release, never a moving tag
        assert re.search(r":v?\d+\.\d+\.\d+(-\d+)?$", image), image


def test_the_controller_runs_two_replicas_on_different_nodes_behind_one_service():
    d = OBJ.get("Deployment", "tpflex-controller")
    assert d["spec"]["replicas"] == 2
    anti = pod_spec(d)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= pod_labels(d).items()
    assert d["spec"]["selector"]["matchLabels"].items() <= pod_labels(d).items()


def test_services_select_pods_and_name_ports_the_pods_have():
    workloads = OBJ.workloads()
    for svc in OBJ.of_kind("Service"):
        selected = [w for w in workloads if svc["spec"]["selector"].items() <= pod_labels(w).items()]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        if svc["spec"].get("clusterIP") == "None":
            name = svc["metadata"]["name"]
            assert any(pod_spec(w).get("subdomain") == name or w["spec"].get("serviceName") == name
                       for w in selected)
            continue
        for port in svc["spec"]["ports"]:
            assert all(port_number(container(w), port["targetPort"]) for w in selected), port


def test_probes_use_declared_ports_and_the_services_real_paths():
    c = container(OBJ.get("Deployment", "tpflex-controller"))
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for w in OBJ.workloads():
        for c in pod_spec(w)["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if p and "exec" not in p:
                    action = p.get("httpGet") or p.get("tcpSocket")
                    assert port_number(c, action["port"]), (w["metadata"]["name"], probe)


def _probe_args(command: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in command if a.startswith("--"))


def test_the_agent_is_ready_when_its_grpc_health_says_serving_over_its_mtls():
    """Readiness through gRPC health: Kubernetes' own grpc probe has no TLS, so an exec
    probe runs deploy/docker/grpc-health-probe.py (installed by the agent's Dockerfile at
    the path the probe runs) against the agent's gRPC port with the agent's mounted
    certificate, whose CN the agent accepts. test_prometheus_live.py runs the probe
    against a real agent."""
    ds = OBJ.get("DaemonSet", "tpflex-agent")
    c = container(ds)
    command = c["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["/opt/tpflex/venv/bin/python", "/opt/tpflex/bin/grpc-health-probe"]
    dockerfile = (REPO / "deploy" / "docker" / "agent.Dockerfile").read_text()
    assert re.search(r"^COPY deploy/docker/grpc-health-probe\.py /opt/tpflex/bin/grpc-health-probe$", dockerfile, re.M)
    assert "python -m venv /opt/tpflex/venv" in dockerfile
    args = _probe_args(command[2:])
    assert int(args["addr"].rsplit(":", 1)[1]) == port_number(c, "grpc")
    mounted = OBJ.mounted_files(ds, c)
    assert {args["ca"], args["cert"], args["key"]} <= mounted
    config = toml_of(OBJ, "tpflex-agent-config", "agent.toml")
    assert args["cert"] == config["grpc"]["tls_cert_file"]  # the agent's own certificate
    assert "tpflex-agent" in config["grpc"]["client_names"]  # its CN (deploy/certs)
    assert args["server_name" if "server_name" in args else "server-name"] == "tpflex-agent"
    from tpflex_agent.service import SERVICE_NAME
    assert args["service"] == SERVICE_NAME
    assert c["readinessProbe"]["timeoutSeconds"] > float(args["timeout"])


def test_every_container_has_cpu_and_memory_requests_and_limits():
    for w in OBJ.workloads():
        for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", []):
            r = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(r.get(kind, {})), (w["metadata"]["name"], c["name"], kind)
    _, trainer = _trainer()
    gpus = trainer["resources"]["limits"]["nvidia.com/gpu"]
    assert trainer["resources"]["requests"]["nvidia.com/gpu"] == gpus


def _selected(selector: dict, kind: str, name: str) -> bool:
    return selector["matchLabels"].items() <= pod_labels(OBJ.get(kind, name)).items()


def test_the_controller_and_etcd_have_disruption_budgets_that_keep_them_serving():
    pdbs = OBJ.of_kind("PodDisruptionBudget")
    ctl = [p for p in pdbs if _selected(p["spec"]["selector"], "Deployment", "tpflex-controller")]
    etcd = [p for p in pdbs if _selected(p["spec"]["selector"], "StatefulSet", "tpflex-etcd")]
    assert len(ctl) == 1 and len(etcd) == 1
    replicas = OBJ.get("Deployment", "tpflex-controller")["spec"]["replicas"]
    assert 1 <= ctl[0]["spec"]["minAvailable"] < replicas  # a drain can still move one
    members = OBJ.get("StatefulSet", "tpflex-etcd")["spec"]["replicas"]
    assert etcd[0]["spec"]["minAvailable"] == members // 2 + 1  # quorum, and one may go


def _etcd_args() -> dict[str, str]:
    c = container(OBJ.get("StatefulSet", "tpflex-etcd"))
    return {k: v for k, _, v in (a[2:].partition("=") for a in c["args"])}


def test_etcd_is_three_members_with_tls_for_clients_and_peers():
    sts = OBJ.get("StatefulSet", "tpflex-etcd")
    assert sts["spec"]["replicas"] == 3
    anti = pod_spec(sts)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= pod_labels(sts).items()
    headless = OBJ.get("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    ns, svc = sts["metadata"]["namespace"], sts["spec"]["serviceName"]
    members = [f"{sts['metadata']['name']}-{i}" for i in range(3)]
    a = _etcd_args()
    assert a["initial-cluster"] == ",".join(f"{m}=https://{m}.{svc}.{ns}.svc:2380" for m in members)
    assert a["name"] == "$(POD_NAME)" and a["advertise-client-urls"].startswith(f"https://$(POD_NAME).{svc}.{ns}.svc:")
    for url in ("listen-client-urls", "listen-peer-urls", "advertise-client-urls", "initial-advertise-peer-urls"):
        assert a[url].startswith("https://"), url
    assert "client-cert-auth" in a and "peer-client-cert-auth" in a  # a CA-signed certificate required
    c = container(sts)
    mounted = OBJ.mounted_files(sts, c)
    for flag in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file", "peer-trusted-ca-file"):
        assert a[flag] in mounted, flag
    assert next(m for m in c["volumeMounts"] if m["name"] == "data")["mountPath"] == a["data-dir"].rsplit("/", 1)[0]
    assert {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]} == {"data"}
    # the controller and the agents use exactly these members, over TLS, with a password
    client_port = port_number(c, "client")
    want = [f"https://{m}.{svc}.{ns}.svc:{client_port}" for m in members]
    for cm, key in (("tpflex-controller-config", "controller.toml"), ("tpflex-agent-config", "agent.toml")):
        etcd = toml_of(OBJ, cm, key)["etcd"]
        assert etcd["endpoints"] == want and etcd["username"] and etcd["password_file"], cm


def test_etcd_knows_every_flag_of_the_statefulset(tmp_path):
    """Each flag the StatefulSet passes is one etcd accepts (the Debian etcd here, 3.4;
    the image runs 3.5, which kept them all)."""
    from tests.deploy.tools import require_tool, run_tool
    etcd = require_tool("etcd")
    out = run_tool([etcd, "--help"])
    help_text = out.stdout + out.stderr
    for flag in _etcd_args():
        assert re.search(rf"^\s+--{re.escape(flag)}(?=[\s=])", help_text, re.M), flag
    assert not re.search(r"^\s+--client-cert(?=[\s=])", help_text, re.M)  # the check can fail


def _stage(tmp_path: Path, dev_certs: Path, files: set[str]) -> dict[str, str]:
    """Real files standing in for the mounted ones: path in the pod -> path here."""
    out = {}
    for f in files:
        local = tmp_path / f.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        name = Path(f).name
        if (dev_certs / name).exists():
            local.write_bytes((dev_certs / name).read_bytes())
        else:
            local.write_text(SECRET_FILES.get(f"secrets/{name}", "x\n"))
        out[f] = str(local)
    return out


def _remap(text: str, staged: dict[str, str]) -> str:
    for pod_path, local in sorted(staged.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(pod_path, local)
    return text


def _paths_in(config: dict) -> set[str]:
    return {v for section in config.values() for k, v in section.items()
            if isinstance(v, str) and v.startswith("/")}


@pytest.mark.parametrize("workload, configmap, key, loader, ports", [
    (("Deployment", "tpflex-controller"), "tpflex-controller-config", "controller.toml", "controller",
     {"rest": 8470, "trainer": 8471}),
    (("DaemonSet", "tpflex-agent"), "tpflex-agent-config", "agent.toml", "agent",
     {"grpc": 8472, "metrics": 8473}),
])
def test_each_service_loads_its_configmap_and_env_and_finds_its_files(
        workload, configmap, key, loader, ports, tmp_path, dev_certs):
    w = OBJ.get(*workload)
    c = container(w)
    mounted = OBJ.mounted_files(w, c)
    config_path = c["args"][c["args"].index("--config") + 1]
    assert config_path in mounted
    config = toml_of(OBJ, configmap, key)
    missing = _paths_in(config) - mounted
    assert not missing, f"{workload[1]} is told to open files no volume provides: {missing}"
    staged = _stage(tmp_path, dev_certs, _paths_in(config))
    text = _remap(OBJ.get("ConfigMap", configmap)["data"][key], staged)
    (tmp_path / key).write_text(text)
    env = {k: v for k, v in env_of(c, FIELDS).items() if k.startswith("TPFLEX_")}
    if loader == "controller":
        s = controller_settings({}, config_file=str(tmp_path / key), env=env)
        assert s.controller.name == FIELDS["metadata.name"]
        bound = {"rest": s.rest.port, "trainer": s.trainer.port}
    else:
        s = agent_settings({}, env, str(tmp_path / key))
        assert s.node == FIELDS["spec.nodeName"] and s.rack == ""  # the rack from the fabric
        assert s.grpc.advertised(0) == f"{FIELDS['status.podIP']}:{s.grpc.port}"
        assert s.metrics.advertised(0) == f"{FIELDS['status.podIP']}:{s.metrics.port}"
        bound = {"grpc": s.grpc.port, "metrics": s.metrics.port}
    assert bound == ports
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports


def test_the_agent_gets_the_nvidia_devices_and_only_cap_sys_admin():
    ds = OBJ.get("DaemonSet", "tpflex-agent")
    c = container(ds)
    caps = c["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert not c["securityContext"].get("privileged", False)
    env = env_of(c, FIELDS)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and pod_spec(ds)["runtimeClassName"] == "nvidia"
    assert next(e for e in c["env"] if e["name"] == "TPFLEX_AGENT__NODE")["valueFrom"]["fieldRef"] == \
        {"fieldPath": "spec.nodeName"}


def _trainer():
    job = OBJ.get("Job", "llm-demo")
    return job, container(job, "trainer")


def test_the_training_job_runs_tpflex_run_with_arguments_it_accepts(tmp_path):
    job, c = _trainer()
    assert c["command"] == ["tpflex-run"]
    own, command = cli._split(c["args"])
    ns = cli._parser().parse_args(own)
    assert command, "no training command after --"
    mounted = OBJ.mounted_files(job, c)
    for flag in ("job_spec", "tls_ca", "tls_cert", "tls_key"):
        assert getattr(ns, flag) in mounted, flag
    # the controller Service, its trainer port, the certificate name the controller has
    svc = OBJ.get("Service", "tpflex-controller")
    host, port = ns.controller.rsplit(":", 1)
    assert host == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert int(port) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "trainer")
    assert ns.tls_server_name == "tpflex-controller"  # CN/SAN of deploy/certs' controller.pem
    controller = toml_of(OBJ, "tpflex-controller-config", "controller.toml")
    assert controller["trainer"]["client_names"] == ["tpflex-trainer"]  # the trainer.pem CN
    assert pod_spec(job)["terminationGracePeriodSeconds"] > ns.grace_period_s
    # the job spec in the ConfigMap is one tpflex-run accepts, one pod per node it names
    spec_file = tmp_path / "job.json"
    spec_file.write_text(OBJ.get("ConfigMap", "tpflex-train-spec")["data"]["job.json"])
    spec = load_spec(str(spec_file))
    nodes = {g.node for rep in spec.replicas for st in rep.stages for g in st.ranks}
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == len(nodes)
    per_node = {n: sum(1 for rep in spec.replicas for st in rep.stages for g in st.ranks if g.node == n)
                for n in nodes}
    assert set(per_node.values()) == {c["resources"]["limits"]["nvidia.com/gpu"]}
    assert job["metadata"]["labels"]["tpflex.io/job"] == spec.name


def _source_text(package: str) -> str:
    return "\n".join(p.read_text() for p in (REPO / package).rglob("*.py"))


def test_every_tpflex_variable_in_the_pods_is_read_by_the_program():
    """TPFLEX_<SECTION>__<KEY> names were loaded above; the rest must occur in the
    program's source (the trainer's, or the demo script it runs)."""
    job, c = _trainer()
    names = {e["name"] for e in c["env"]}
    trainer_source = _source_text("trainer_hooks")
    for name in names:
        if name.startswith(("NCCL_", "GLOO_", "PYTHON")):
            continue  # read by NCCL, gloo, the interpreter
        assert f'"{name}"' in trainer_source, f"{name} is read by nothing in tpflex_trainer"
    node_env = next(e for e in c["env"] if e["name"] == "NODE_NAME")
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"  # = the agent's node
    for w in OBJ.workloads():
        for cc in pod_spec(w)["containers"]:
            for e in cc.get("env", []):
                if e["name"].startswith("TPFLEX_") and "__" not in e["name"]:
                    assert f'"{e["name"]}"' in trainer_source, e["name"]


def test_pods_mount_only_their_own_identity():
    identities = {("Deployment", "tpflex-controller"): "controller", ("DaemonSet", "tpflex-agent"): "agent",
                  ("Job", "llm-demo"): "trainer", ("StatefulSet", "tpflex-etcd"): "etcd"}
    for (kind, name), me in identities.items():
        w = OBJ.get(kind, name)
        keys = {Path(f).name for f in OBJ.mounted_files(w, container(w))}
        pems = {k for k in keys if k.endswith(".pem") and k != "ca.pem"}
        assert pems and all(re.match(rf"{me}(-key)?\.pem$", k) for k in pems), (name, pems)


def test_the_optional_prometheus_operator_objects_scrape_what_the_alerts_expect():
    """deploy/kubernetes/optional/servicemonitor.yaml (CRDs: not in the schema
    kubernetes-validate knows): the controller's Service and the agents' pods, by port
    names they have, over HTTPS, with the job label the alerts match on."""
    import yaml
    docs = [d for d in yaml.safe_load_all((KUBE / "optional" / "servicemonitor.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ServiceMonitor", "PodMonitor"}
    alerts = (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()
    jobs = re.search(r'up\{job=~"([^"]+)"\}', alerts).group(1).split("|")
    sm = by_kind["ServiceMonitor"]
    svc = OBJ.get("Service", "tpflex-controller")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] in jobs
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    pm = by_kind["PodMonitor"]
    ds = OBJ.get("DaemonSet", "tpflex-agent")
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels(ds).items()
    assert pod_labels(ds)[pm["spec"]["jobLabel"]] in jobs
    assert all(port_number(container(ds), e["port"]) for e in pm["spec"]["podMetricsEndpoints"])
    for e in sm["spec"]["endpoints"] + pm["spec"]["podMetricsEndpoints"]:
        assert e["scheme"] == "https" and e["path"] == "/metrics" and e["tlsConfig"]["keySecret"]
