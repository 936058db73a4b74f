"""The RayJob and RayCluster manifests against the real KubeRay v1.7.0 CRD schemas.

The API server validates a custom resource against its CRD's openAPIV3Schema, and `kubectl apply`
asks it for strict field validation, which rejects unknown fields. jsonschema's Draft7Validator
does both offline once the schema says so: every object that lists its properties (and does not
preserve unknown fields) gets additionalProperties: false.
"""

from __future__ import annotations

import copy
import functools

import pytest
import yaml
from jsonschema import Draft7Validator

CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
API_VERSION = "ray.io/v1"


def _strict(node):
    """OpenAPI v3 (Kubernetes dialect) -> Draft 7, rejecting unknown fields as the server does."""
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    out.pop("nullable", None)
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validator(crd_path: str) -> Draft7Validator:
    # The CRDs are 2 MB of YAML: libyaml's safe loader reads them ~6x faster than pure Python.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(crd_path) as f:
        crd = yaml.load(f, Loader=loader)
    group = crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if f"{group}/{v['name']}" == API_VERSION]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema)


def schema_errors(crd_dir, obj: dict) -> list[str]:
    validator = _validator(str(crd_dir / CRD_FILES[obj["kind"]]))
    return sorted(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(obj)
    )


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_manifest_is_valid_under_kuberay_v1_crd_schema(kuberay_crd_dir, find_object, kind):
    obj = find_object(kind)
    assert obj["apiVersion"] == API_VERSION, (
        f"{kind} apiVersion {obj['apiVersion']!r}; served: {API_VERSION}"
    )
    assert schema_errors(kuberay_crd_dir, obj) == []


def test_schema_rejects_unknown_field_and_wrong_types(kuberay_crd_dir, rayjob):
    """The validator is strict enough to catch the mistakes that reach a real cluster."""
    bad = copy.deepcopy(rayjob)
    group = bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["template"]["spec"]["containers"][0]["resource"] = {}  # typo of "resources"
    group["rayStartParams"]["num-gpus"] = 1  # must be a string
    group["minReplicas"] = "2"  # must be an integer
    bad["spec"]["shutdownAfterJobFinish"] = True  # typo of shutdownAfterJobFinishes
    errors = "\n".join(schema_errors(kuberay_crd_dir, bad))
    assert "'resource' was unexpected" in errors
    assert "rayStartParams/num-gpus: 1 is not of type 'string'" in errors
    assert "minReplicas: '2' is not of type 'integer'" in errors
    assert "'shutdownAfterJobFinish' was unexpected" in errors
