"""deploy/docker/: the controller, agent and trainer images' Dockerfiles, checked without a
Docker engine (none here): a pinned base image with the Python the packages require, COPY
sources that exist (or are the wheels `make dist` writes), what BuildKit's per-Dockerfile
ignore file lets through, entrypoints that are console scripts the installed packages
declare, and agreement with the Kubernetes manifests (image names, user, probe path)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from tests.deploy.kube import Objects, container, pod_spec
from tests.deploy.tools import DEPLOY, REPO

DOCKER = DEPLOY / "docker"
# image -> (Dockerfile, the component it installs, the workload that runs it)
IMAGES = {
    "controller": ("controller.Dockerfile", "controller", ("Deployment", "tpflex-controller")),
    "agent": ("agent.Dockerfile", "agent", ("DaemonSet", "tpflex-agent")),
    "trainer": ("trainer.Dockerfile", "trainer_hooks", ("Job", "llm-demo")),
}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _project(component: str) -> dict:
    return tomllib.loads((REPO / component / "pyproject.toml").read_text())["project"]


def _wheel_glob_matches(pattern: str, component: str) -> bool:
    """Whether ``dist/<pattern>`` matches the wheel `make dist` builds for ``component``
    (its distribution name normalised, any version)."""
    dist = _project(component)["name"].replace("-", "_")
    return fnmatch.fnmatch(f"{dist}-0.1.0-py3-none-any.whl", pattern)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_the_base_image_is_pinned_to_a_python_the_packages_accept(image):
    dockerfile, component, _ = IMAGES[image]
    froms = [args for word, args in _instructions(DOCKER / dockerfile) if word == "FROM"]
    assert len(froms) == 1
    m = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-(\w+)(@sha256:[0-9a-f]{64})?", froms[0])
    assert m, f"{dockerfile}: base image {froms[0]!r} is not pinned to a Python release"
    requires = _project(component)["requires-python"]
    low = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", requires).groups())
    assert (int(m.group(1)), int(m.group(2))) >= low


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copy_sources_exist_or_are_the_wheels_make_dist_builds(image):
    dockerfile, component, _ = IMAGES[image]
    ignore = (DOCKER / f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = [x[1:].rstrip("/") for x in ignore if x.startswith("!")]
    assert "*" in ignore  # everything else stays out of the build context (.venv, .git, ...)
    wheels = set()
    for word, args in _instructions(DOCKER / dockerfile):
        if word != "COPY":
            continue
        *sources, _dest = args.split()
        for src in sources:
            assert any(src == a or src.startswith(a + "/") for a in allowed), \
                f"{dockerfile}: {src} is left out of the context by its .dockerignore"
            if src.startswith("dist/"):
                wheels.add(src)
            else:
                assert (REPO / src).is_file(), f"{dockerfile}: COPY {src}: no such file"
    # the component's wheel and the proto wheel it depends on, nothing else
    assert len(wheels) == 2
    assert any(_wheel_glob_matches(w[len("dist/"):], component) for w in wheels)
    assert any(_wheel_glob_matches(w[len("dist/"):], "proto") for w in wheels)
    assert not any(_wheel_glob_matches(w[len("dist/"):], other) for w in wheels
                   for other in ("controller", "agent", "trainer_hooks") if other != component)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^COMPONENTS\s*[:?]?=.*\b" + re.escape(component) + r"\b", makefile, re.M)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_the_entrypoint_is_a_console_script_of_the_installed_package(image):
    dockerfile, component, workload = IMAGES[image]
    entry = [args for word, args in _instructions(DOCKER / dockerfile) if word == "ENTRYPOINT"]
    assert len(entry) == 1
    program = re.fullmatch(r'\["([\w-]+)"\]', entry[0]).group(1)
    assert program in _project(component)["scripts"], f"{program} is not a script of {component}"
    text = (DOCKER / dockerfile).read_text()
    assert "ENV PATH=/opt/tpflex/venv/bin:$PATH" in text and "python -m venv /opt/tpflex/venv" in text
    # the pod runs the same program (its own command, or the image's entrypoint with args)
    c = container(Objects.load().get(*workload))
    assert c.get("command", [program])[0] == program


def test_the_images_the_manifests_run_are_the_ones_documented_here():
    doc = (REPO / "docs" / "deploy.md").read_text()
    objects = Objects.load()
    for image, (dockerfile, _component, workload) in IMAGES.items():
        ref = container(objects.get(*workload))["image"]
        assert ref.startswith(f"tpflex/{image}:")
        build = f"docker build -f deploy/docker/{dockerfile} -t {ref} ."
        assert build in (DOCKER / dockerfile).read_text(), dockerfile
        assert build in doc, f"docs/deploy.md does not show: {build}"


def test_the_controller_image_user_is_the_pods_and_the_agent_image_runs_as_root():
    text = (DOCKER / "controller.Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    ctl = pod_spec(Objects.load().get("Deployment", "tpflex-controller"))["securityContext"]
    assert (int(user.group(1)), int(user.group(2))) == (ctl["runAsUser"], ctl["runAsGroup"])
    assert "--uid 10001" in text and "--gid 10001" in text
    assert not re.search(r"^USER ", (DOCKER / "agent.Dockerfile").read_text(), re.M)  # NVML set calls
