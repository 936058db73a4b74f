"""Shared fixtures for the deploy/ tests: the repo, the loaded manifests, the train commands.

The manifests are only YAML here (no Kubernetes, no cloud), so these tests check what can be
checked offline: the real KubeRay CRD schemas, the operator's own rules, and that every command
names the project's real module and config keys.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deploy_helpers import (  # noqa: E402
    DEPLOY_DIR,
    KUBERAY_DIR,
    REPO_ROOT,
    SHARED_DIR,
    TRAIN_MODULE,
    code_blocks,
    load_documents,
    overrides,
    ray_container,
    train_commands,
)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def kuberay_crd_dir() -> Path:
    crd_dir = SHARED_DIR / "kuberay"
    if not (crd_dir / "ray.io_rayjobs.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {crd_dir} (the shared folder beside the repo)")
    return crd_dir


@pytest.fixture(scope="session")
def kube_docs() -> dict[str, list[dict]]:
    """deploy/kuberay/*.yaml -> the documents of each file."""
    files = sorted(KUBERAY_DIR.glob("*.yaml"))
    assert files, f"no manifests in {KUBERAY_DIR}"
    return {p.name: load_documents(p) for p in files}


@pytest.fixture(scope="session")
def kube_objects(kube_docs) -> list[dict]:
    return [doc for docs in kube_docs.values() for doc in docs]


def _only(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [
        o
        for o in objects
        if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (
        f"expected exactly one {kind} {name or ''} in deploy/kuberay, found {len(found)}"
    )
    return found[0]


@pytest.fixture(scope="session")
def find_object(kube_objects):
    return lambda kind, name=None: _only(kube_objects, kind, name)


@pytest.fixture(scope="session")
def rayjob(kube_objects) -> dict:
    return _only(kube_objects, "RayJob")


@pytest.fixture(scope="session")
def raycluster(kube_objects) -> dict:
    return _only(kube_objects, "RayCluster")


@pytest.fixture(scope="session")
def ray_cluster_specs(rayjob, raycluster) -> dict[str, dict]:
    """Every RayCluster spec we ship: the interactive cluster and the one the RayJob creates."""
    return {"raycluster.yaml": raycluster["spec"], "rayjob.yaml": rayjob["spec"]["rayClusterSpec"]}


@pytest.fixture(scope="session")
def rayjob_overrides(rayjob) -> dict[str, str]:
    commands = train_commands(rayjob["spec"]["entrypoint"])
    assert len(commands) == 1, (
        f"RayJob entrypoint should run {TRAIN_MODULE} once: {rayjob['spec']['entrypoint']!r}"
    )
    return overrides(commands[0])


@pytest.fixture(scope="session")
def readme_text() -> str:
    """deploy/README.md, whole."""
    return (DEPLOY_DIR / "README.md").read_text()


@pytest.fixture(scope="session")
def project_image(rayjob) -> str:
    """The image of the RayJob's head: every Ray pod, the submitter, MLflow and the cloud nodes
    must run this same one (deploy/README.md replaces it in one sed)."""
    return ray_container(rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"])["image"]


@pytest.fixture(scope="session")
def readme_commands(readme_text) -> str:
    """The fenced code blocks of deploy/README.md: what users copy and run."""
    return code_blocks(readme_text)
