"""What the KubeRay operator and an elastic GPU run demand beyond the CRD schema.

The schema leaves these to defaults or to nobody: worker groups written out in full with
minReplicas <= replicas <= maxReplicas and string rayStartParams (the operator's rules), one GPU
per worker pod and none on the head (one Train worker actor per GPU pod), autoscaling on, a
memory-backed /dev/shm for NCCL and the object store, and a preStop `ray stop`.
"""

from __future__ import annotations

import copy
import re
import shlex
from urllib.parse import urlparse

from deploy_helpers import (
    logical_lines,
    overrides,
    quantity,
    ray_container,
    train_commands,
)

GPU = "nvidia.com/gpu"
MIN_SHM_BYTES = 1 << 30  # NCCL and the object store need far more than Docker's 64 MiB default
# Bucket scheme -> the ServiceAccount annotation that gives a pod short-lived credentials for it.
WORKLOAD_IDENTITY = {"s3": "eks.amazonaws.com/role-arn", "gs": "iam.gke.io/gcp-service-account"}


def _group_problems(where: str, group: dict) -> list[str]:
    problems = []
    for key in ("groupName", "minReplicas", "maxReplicas", "replicas", "template"):
        if key not in group:
            problems.append(
                f"{where}: {key} missing (write it out; the operator's default is not what you "
                "want)"
            )
    lo, n, hi = group.get("minReplicas"), group.get("replicas"), group.get("maxReplicas")
    if None not in (lo, n, hi) and not lo <= n <= hi:
        problems.append(
            f"{where}: needs minReplicas <= replicas <= maxReplicas, got {lo} <= {n} <= {hi}"
        )
    return problems


def _string_params(where: str, params: dict) -> list[str]:
    return [
        f"{where}.rayStartParams.{k}: {v!r} is {type(v).__name__}; the operator wants a string"
        for k, v in params.items()
        if not isinstance(v, str)
    ]


def _gpu_problems(where: str, container: dict, expected: int) -> list[str]:
    res = container.get("resources", {})
    limits, requests = res.get("limits", {}), res.get("requests", {})
    if expected == 0:
        return [
            f"{where}: {GPU} in {part}; the head must have no GPU"
            for part, d in (("limits", limits), ("requests", requests))
            if GPU in d
        ]
    problems = []
    if GPU not in limits or quantity(limits[GPU]) != expected:
        problems.append(
            f"{where}: limits.{GPU} is {limits.get(GPU)!r}; one GPU per worker pod needs {expected}"
        )
    if GPU in requests and quantity(requests[GPU]) != quantity(limits.get(GPU, 0)):
        problems.append(f"{where}: requests.{GPU} {requests[GPU]!r} differs from the limit")
    return problems


def _shm_problems(where: str, template: dict) -> list[str]:
    container = ray_container(template)
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    if "/dev/shm" not in mounts:
        return [f"{where}: no volume mounted at /dev/shm"]
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    empty_dir = volumes.get(mounts["/dev/shm"], {}).get("emptyDir")
    if not empty_dir or empty_dir.get("medium") != "Memory":
        return [f"{where}: /dev/shm must be an emptyDir with medium: Memory"]
    if "sizeLimit" not in empty_dir:
        return [f"{where}: /dev/shm emptyDir needs a sizeLimit"]
    size = quantity(empty_dir["sizeLimit"])
    memory = quantity(container["resources"]["limits"]["memory"])
    if not MIN_SHM_BYTES <= size < memory:
        return [
            f"{where}: /dev/shm sizeLimit {empty_dir['sizeLimit']} must be >= 1Gi and below the "
            f"container memory limit {container['resources']['limits']['memory']} (it counts "
            "against it)"
        ]
    return []


def _prestop_problems(where: str, container: dict) -> list[str]:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if "ray stop" not in " ".join(command):
        return [f"{where}: lifecycle.preStop must run `ray stop`, has {command!r}"]
    return []


def operator_problems(spec: dict) -> list[str]:
    """Everything wrong with one RayCluster spec, as sentences; empty when all is well."""
    problems = []
    head = spec["headGroupSpec"]
    problems += _string_params("head", head.get("rayStartParams", {}))
    if head.get("rayStartParams", {}).get("num-gpus") != "0":
        problems.append(
            'head: rayStartParams.num-gpus must be "0" so no GPU work lands on the head'
        )
    for i, c in enumerate(head["template"]["spec"]["containers"]):
        problems += _gpu_problems(f"head container {i}", c, expected=0)
    problems += _shm_problems("head", head["template"])
    problems += _prestop_problems("head", ray_container(head["template"]))

    groups = spec.get("workerGroupSpecs", [])
    if not groups:
        problems.append("no workerGroupSpecs: the run has nowhere to put its GPU workers")
    names = [g.get("groupName") for g in groups]
    if len(set(names)) != len(names):
        problems.append(f"worker groupName values repeat: {names}")
    for g in groups:
        where = f"worker group {g.get('groupName')!r}"
        problems += _group_problems(where, g)
        if "template" not in g:
            continue
        params = g.get("rayStartParams", {})
        problems += _string_params(where, params)
        if params.get("num-gpus", "1") != "1":
            problems.append(
                f"{where}: rayStartParams.num-gpus {params['num-gpus']!r} disagrees with 1 GPU "
                "per pod"
            )
        problems += _gpu_problems(where, ray_container(g["template"]), expected=1)
        problems += _shm_problems(where, g["template"])
        problems += _prestop_problems(where, ray_container(g["template"]))

    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(
            "enableInTreeAutoscaling must be true: the elastic run grows with the group"
        )
    if not isinstance(spec.get("autoscalerOptions"), dict):
        problems.append("autoscalerOptions missing")
    if groups and not any(g.get("maxReplicas", 0) > g.get("minReplicas", 0) for g in groups):
        problems.append("no worker group can grow (maxReplicas == minReplicas everywhere)")
    return problems


def test_shipped_ray_clusters_meet_operator_and_gpu_rules(ray_cluster_specs):
    found = {name: operator_problems(spec) for name, spec in ray_cluster_specs.items()}
    assert found == {name: [] for name in ray_cluster_specs}


def test_rule_check_reports_each_broken_rule(ray_cluster_specs):
    spec = copy.deepcopy(ray_cluster_specs["rayjob.yaml"])
    group = spec["workerGroupSpecs"][0]
    group["replicas"] = group["maxReplicas"] + 1
    group["rayStartParams"]["num-gpus"] = 1
    ray_container(group["template"])["resources"]["limits"][GPU] = 2
    del ray_container(group["template"])["lifecycle"]
    ray_container(spec["headGroupSpec"]["template"])["resources"]["limits"][GPU] = 1
    spec["headGroupSpec"]["template"]["spec"]["volumes"][0]["emptyDir"].pop("medium")
    spec["enableInTreeAutoscaling"] = False
    problems = "\n".join(operator_problems(spec))
    for expected in (
        "minReplicas <= replicas <= maxReplicas",
        "rayStartParams.num-gpus: 1 is int",
        f"limits.{GPU} is 2",
        "preStop must run `ray stop`",
        "head must have no GPU",
        "medium: Memory",
        "enableInTreeAutoscaling must be true",
    ):
        assert expected in problems


def test_token_authentication_and_ray_version_match_the_project(ray_cluster_specs):
    """Ray 2.60 token auth on (KubeRay makes the token); rayVersion is the Ray the project pins."""
    from importlib.metadata import version

    for name, spec in ray_cluster_specs.items():
        assert spec.get("authOptions", {}).get("mode") == "token", (
            f"{name}: authOptions.mode should be token"
        )
        assert spec["rayVersion"] == version("ray"), (
            f"{name}: rayVersion {spec['rayVersion']} != ray {version('ray')}"
        )


def _all_containers(kube_objects):
    for obj in kube_objects:
        spec = obj.get("spec", {})
        templates = []
        if obj["kind"] in ("RayCluster", "RayJob"):
            cluster = spec if obj["kind"] == "RayCluster" else spec["rayClusterSpec"]
            templates = [cluster["headGroupSpec"]["template"]] + [
                g["template"] for g in cluster["workerGroupSpecs"]
            ]
            if obj["kind"] == "RayJob" and "submitterPodTemplate" in spec:
                templates.append(spec["submitterPodTemplate"])
        elif obj["kind"] == "Deployment":
            templates = [spec["template"]]
        for t in templates:
            for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]:
                yield obj, c


def test_every_project_container_runs_one_image_tagged_with_the_project_version(
    kube_objects, project_image, repo_root
):
    import tomllib

    version = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    tagged = project_image.partition("@")[0]  # the digest pins it; the tag says which release
    assert tagged.endswith(f":{version}"), f"image {project_image} should be tagged {version}"
    name = tagged.rsplit(":", 1)[0]
    for obj, c in _all_containers(kube_objects):
        if c["image"].partition("@")[0].rsplit(":", 1)[0] == name or obj["kind"] in (
            "RayCluster",
            "RayJob",
        ):
            assert c["image"] == project_image, (
                f"{obj['kind']} {obj['metadata']['name']}/{c['name']}: {c['image']}"
            )


def test_all_objects_live_in_the_shipped_namespace(kube_objects, find_object):
    namespace = find_object("Namespace")["metadata"]["name"]
    for obj in kube_objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == namespace, (
                f"{obj['kind']} {obj['metadata']['name']}"
            )


def _storage_problems(where: str, storage: str, spec: dict, find_object) -> list[str]:
    """Every Ray pod must reach the checkpoint storage: a bucket through the workload identity of
    its ServiceAccount, or the same shared volume."""
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    problems = []
    scheme = urlparse(storage).scheme
    for pod, template in templates.items():
        container = ray_container(template)
        if scheme in WORKLOAD_IDENTITY:
            account = template["spec"].get("serviceAccountName")
            annotations = (
                find_object("ServiceAccount", account)["metadata"].get("annotations", {})
                if account
                else {}
            )
            if WORKLOAD_IDENTITY[scheme] not in annotations:
                problems.append(
                    f"{where} {pod}: reaches {storage} only through a ServiceAccount annotated "
                    f"{WORKLOAD_IDENTITY[scheme]}, has {account!r}"
                )
        elif scheme == "":
            claims = {
                v["name"]: v["persistentVolumeClaim"]["claimName"]
                for v in template["spec"].get("volumes", [])
                if "persistentVolumeClaim" in v
            }
            mounts = [
                m
                for m in container.get("volumeMounts", [])
                if m["name"] in claims
                and (storage + "/").startswith(m["mountPath"].rstrip("/") + "/")
            ]
            if not mounts:
                problems.append(f"{where} {pod}: no shared volume mounted above {storage}")
            for m in mounts:
                pvc = find_object("PersistentVolumeClaim", claims[m["name"]])
                if "ReadWriteMany" not in pvc["spec"]["accessModes"]:
                    problems.append(f"{where} {pod}: {claims[m['name']]} must be ReadWriteMany")
        else:
            problems.append(f"{where}: storage {storage!r} is not a path, s3:// or gs:// URI")
    return problems


def test_rayjob_storage_is_reachable_from_every_pod(rayjob, rayjob_overrides, find_object):
    storage = rayjob_overrides["cluster.storage_path"]
    assert (
        _storage_problems("rayjob.yaml", storage, rayjob["spec"]["rayClusterSpec"], find_object)
        == []
    )


def test_interactive_cluster_shares_a_volume_used_by_the_readme_commands(
    raycluster, readme_commands, find_object
):
    """README runs that log to the in-cluster MLflow run on Kubernetes: a path they store to must
    be on the volume every pod of the RayCluster mounts."""
    runs = [overrides(c) for c in train_commands(readme_commands)]
    local = {
        o["cluster.storage_path"]
        for o in runs
        if ".svc.cluster.local" in o.get("tracking.tracking_uri", "")
        and o.get("cluster.storage_path", "").startswith("/")
    }
    assert local, "deploy/README.md should show a run on the interactive cluster's shared volume"
    for path in sorted(local):
        assert _storage_problems("raycluster.yaml", path, raycluster["spec"], find_object) == []


def test_stable_run_name_and_resume_settings(rayjob, rayjob_overrides):
    """Resubmitting resumes only if the name is fixed in the manifest, not generated per run."""
    name = rayjob_overrides.get("cluster.run_name", "")
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), (
        f"cluster.run_name {name!r} should be a fixed name"
    )
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    assert rayjob["spec"].get("backoffLimit", 0) >= 1, (
        "a failed attempt should be retried (and resume)"
    )


def test_rayjob_submitter_runs_the_project_image(rayjob, project_image):
    template = rayjob["spec"]["submitterPodTemplate"]
    assert template["spec"]["restartPolicy"] == "Never"
    assert ray_container(template)["image"] == project_image
    assert "command" not in ray_container(template), "KubeRay fills in the `ray job submit` command"


def test_elastic_range_fits_the_gpu_worker_groups(rayjob, rayjob_overrides):
    spec = rayjob["spec"]["rayClusterSpec"]
    capacity = sum(
        g["maxReplicas"] * quantity(ray_container(g["template"])["resources"]["limits"][GPU])
        for g in spec["workerGroupSpecs"]
    )
    lo, hi = (
        int(rayjob_overrides["cluster.min_workers"]),
        int(rayjob_overrides["cluster.max_workers"]),
    )
    assert rayjob_overrides["cluster.use_gpu"] == "true"
    assert 1 <= lo < hi <= capacity, (
        f"elastic range {lo}..{hi} must fit {capacity} GPUs and be a range"
    )


def test_secrets_the_manifests_read_are_created_in_the_readme(kube_objects, readme_commands):
    """Every secretKeyRef names a Secret and key the README tells the user to create."""
    created = {}
    for line in logical_lines(readme_commands):
        if "kubectl create secret generic" not in line:
            continue
        tokens = shlex.split(line.replace("$(", "(").replace('"', ""), comments=True)
        name = tokens[tokens.index("generic") + 1]
        keys = {t.split("=", 2)[1] for t in tokens if t.startswith("--from-literal=")}
        created.setdefault(name, set()).update(keys)
    for obj, c in _all_containers(kube_objects):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in created.get(ref["name"], set()), (
                    f"{obj['metadata']['name']}/{c['name']} reads Secret {ref['name']} key "
                    f"{ref['key']}, "
                    f"which deploy/README.md never creates (it creates {created})"
                )
