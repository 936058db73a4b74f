"""deploy/ is locked down: what a hostile review of the manifests checks, offline.

Each check is a function from the loaded manifests (or a file's text) to a list of problems, so
the same function runs on the shipped files and on a deliberately broken copy. Covered: every pod
and container unprivileged; MLflow behind basic auth and a NetworkPolicy that admits the Ray pods
and a labelled ingress only; no secret on a command line; images by digest; the cloud launchers'
dashboard private; pip installs pinned; workload identity instead of static cloud keys.
"""

from __future__ import annotations

import re
import shlex

import tomllib
from deploy_helpers import CLOUD_DIR, DEPLOY_DIR, REPO_ROOT, container_env, load_documents

DOCKERFILE = DEPLOY_DIR / "docker" / "Dockerfile"
CONSTRAINTS = DEPLOY_DIR / "docker" / "constraints.txt"
CLOUD_FILES = ("aws.yaml", "gcp.yaml")
# `name[:tag]@sha256:<64 hex>`: the runtime pulls the digest. The shipped manifests carry the
# all-zero placeholder that deploy/README.md's release step substitutes.
DIGEST_IMAGE = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
# Containers whose root filesystem stays writable, and why (the manifests say so beside them).
WRITABLE_ROOT = {
    "ray-head": "Ray's session, job working dirs and caches live in the image's paths",
    "ray-worker": "as ray-head",
    "autoscaler": "KubeRay's sidecar in the head pod: the same Ray",
}
STATIC_KEY_ENV = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"}
IDENTITY_ANNOTATIONS = ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account")
RAY_ROLE = {"elastic-fsdp/role": "ray"}
INGRESS_LABEL = {"elastic-fsdp/mlflow-access": "allowed"}


def ray_cluster_spec(obj: dict) -> dict | None:
    if obj.get("kind") == "RayCluster":
        return obj["spec"]
    if obj.get("kind") == "RayJob":
        return obj["spec"]["rayClusterSpec"]
    return None


def pod_templates(objects: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every pod the manifests make: workloads, Ray groups, submitters."""
    found = []
    for obj in objects:
        name = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        spec = obj.get("spec", {})
        if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            found.append((name, spec["template"]))
        elif obj.get("kind") == "CronJob":
            found.append((name, spec["jobTemplate"]["spec"]["template"]))
        cluster = ray_cluster_spec(obj)
        if cluster is not None:
            found.append((f"{name} head", cluster["headGroupSpec"]["template"]))
            found += [
                (f"{name} group {g['groupName']}", g["template"])
                for g in cluster.get("workerGroupSpecs", [])
            ]
        if obj.get("kind") == "RayJob":
            found.append((f"{name} submitter", spec.get("submitterPodTemplate", {"spec": {}})))
    return found


def containers(template: dict) -> list[dict]:
    spec = template.get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def _container_problems(where: str, pod_sc: dict, c: dict) -> list[str]:
    sc = c.get("securityContext", {})
    merged = {**pod_sc, **sc}  # a container's setting overrides its pod's
    here = f"{where}/{c.get('name')}"
    problems = []
    if merged.get("runAsNonRoot") is not True:
        problems.append(f"{here}: runAsNonRoot must be true")
    if not isinstance(merged.get("runAsUser"), int) or merged["runAsUser"] == 0:
        problems.append(f"{here}: runAsUser must be a non-zero uid, is {merged.get('runAsUser')!r}")
    if merged.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append(f"{here}: seccompProfile must be RuntimeDefault")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{here}: allowPrivilegeEscalation must be false")
    if "ALL" not in sc.get("capabilities", {}).get("drop", []):
        problems.append(f"{here}: capabilities must drop ALL")
    if sc.get("capabilities", {}).get("add"):
        problems.append(f"{here}: adds capabilities {sc['capabilities']['add']}")
    if sc.get("privileged"):
        problems.append(f"{here}: privileged")
    read_only = sc.get("readOnlyRootFilesystem")
    if read_only is not True and not (read_only is False and c.get("name") in WRITABLE_ROOT):
        problems.append(
            f"{here}: readOnlyRootFilesystem must be true (writable only for "
            f"{sorted(WRITABLE_ROOT)}, each with its reason), is {read_only!r}"
        )
    return problems


def security_context_problems(objects: list[dict]) -> list[str]:
    problems = []
    for where, template in pod_templates(objects):
        pod_sc = template.get("spec", {}).get("securityContext", {})
        if template.get("spec", {}).get("hostNetwork") or template.get("spec", {}).get("hostPID"):
            problems.append(f"{where}: host namespaces")
        if not containers(template):
            problems.append(f"{where}: no containers found")
        for c in containers(template):
            problems += _container_problems(where, pod_sc, c)
    for obj in objects:
        cluster = ray_cluster_spec(obj)
        if cluster is not None and cluster.get("enableInTreeAutoscaling"):
            sidecar = {
                "name": "autoscaler",
                "securityContext": cluster.get("autoscalerOptions", {}).get("securityContext", {}),
            }
            problems += _container_problems(f"{obj['kind']} autoscaler", {}, sidecar)
    return problems


def _selects(match_labels: dict, labels: dict) -> bool:
    return bool(match_labels) and match_labels.items() <= labels.items()


def _only(objects, kind, name):
    found = [o for o in objects if o.get("kind") == kind and o["metadata"]["name"] == name]
    return found[0] if len(found) == 1 else None


def network_policy_problems(objects: list[dict]) -> list[str]:
    """MLflow's pods are selected by a policy whose every peer is the Ray pods' label (which the
    Ray pod templates really carry) or the documented ingress label on namespace AND pod."""
    mlflow = _only(objects, "Deployment", "mlflow")
    if mlflow is None:
        return ["no Deployment mlflow"]
    labels = mlflow["spec"]["template"]["metadata"]["labels"]
    policies = [
        p
        for p in objects
        if p.get("kind") == "NetworkPolicy"
        and _selects(p["spec"].get("podSelector", {}).get("matchLabels", {}), labels)
    ]
    if not policies:
        return ["no NetworkPolicy selects the MLflow pods by their labels"]
    problems = []
    ray_pods = [(w, t) for w, t in pod_templates(objects) if w.startswith(("RayCluster", "RayJob"))]
    ray_pods = [(w, t) for w, t in ray_pods if not w.endswith("submitter")]
    for where, t in ray_pods:
        if not RAY_ROLE.items() <= t.get("metadata", {}).get("labels", {}).items():
            problems.append(f"{where}: pod template lacks the label {RAY_ROLE}")
    admits_ray = admits_ingress = False
    for p in policies:
        if "Ingress" not in p["spec"].get("policyTypes", ["Ingress"]):
            problems.append(f"NetworkPolicy {p['metadata']['name']}: no Ingress policyType")
        for rule in p["spec"].get("ingress", []):
            if not rule.get("from"):
                problems.append(f"NetworkPolicy {p['metadata']['name']}: a rule admits anyone")
            for peer in rule.get("from", []):
                pods = peer.get("podSelector", {}).get("matchLabels", {})
                spaces = peer.get("namespaceSelector", {}).get("matchLabels", {})
                if "ipBlock" in peer:
                    problems.append(f"NetworkPolicy {p['metadata']['name']}: ipBlock peer")
                elif pods == RAY_ROLE and "namespaceSelector" not in peer:
                    admits_ray = True
                elif pods == INGRESS_LABEL and spaces == INGRESS_LABEL:
                    admits_ingress = True
                else:
                    problems.append(
                        f"NetworkPolicy {p['metadata']['name']}: peer {peer} is neither the Ray "
                        f"pods ({RAY_ROLE}) nor the labelled ingress ({INGRESS_LABEL})"
                    )
    if not admits_ray:
        problems.append(f"MLflow is not reachable from the Ray pods ({RAY_ROLE})")
    if not admits_ingress:
        problems.append(f"no documented ingress selector ({INGRESS_LABEL}) admitted to MLflow")
    if not any(
        p.get("kind") == "NetworkPolicy"
        and p["spec"].get("podSelector") == {}
        and not p["spec"].get("ingress")
        and "Ingress" in p["spec"].get("policyTypes", [])
        for p in objects
    ):
        problems.append("no default-deny ingress NetworkPolicy for the namespace")
    return problems


def secret_in_argv_problems(objects: list[dict]) -> list[str]:
    """No container puts a Secret-backed env var (`$(VAR)`) or a URL with a password in argv."""
    problems = []
    for where, template in pod_templates(objects):
        for c in containers(template):
            argv = " ".join(map(str, c.get("command", []) + c.get("args", [])))
            secret_vars = [
                name
                for name, e in container_env(c).items()
                if "secretKeyRef" in e.get("valueFrom", {})
            ]
            for var in secret_vars:
                if f"$({var})" in argv:
                    problems.append(f"{where}/{c['name']}: Secret-backed $({var}) in argv")
            if re.search(r"://[^/\s:@]*:[^/\s@]+@", argv):
                problems.append(f"{where}/{c['name']}: a URL with a password in argv")
    return problems


def mlflow_auth_problems(objects: list[dict]) -> list[str]:
    mlflow = _only(objects, "Deployment", "mlflow")
    if mlflow is None:
        return ["no Deployment mlflow"]
    spec = mlflow["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "mlflow"]
    argv = c.get("command", []) + c.get("args", [])
    if "--app-name=basic-auth" not in argv and "--app-name basic-auth" not in " ".join(argv):
        return ["mlflow server does not run the basic-auth app (--app-name=basic-auth)"]
    config = container_env(c).get("MLFLOW_AUTH_CONFIG_PATH", {}).get("value", "")
    secret_mounts = {
        m["mountPath"]
        for m in c.get("volumeMounts", [])
        for v in spec.get("volumes", [])
        if v["name"] == m["name"] and "secret" in v
    }
    if not any(config.startswith(path.rstrip("/") + "/") for path in secret_mounts):
        return [f"MLFLOW_AUTH_CONFIG_PATH {config!r} is not a file of a mounted Secret"]
    return []


def image_problems(images: list[tuple[str, str]]) -> list[str]:
    return [
        f"{where}: image {image!r} is not pinned by digest (name:tag@sha256:<64 hex>)"
        for where, image in images
        if not DIGEST_IMAGE.match(str(image))
    ]


def kube_images(objects: list[dict]) -> list[tuple[str, str]]:
    return [
        (f"{where}/{c.get('name')}", c.get("image", ""))
        for where, t in pod_templates(objects)
        for c in containers(t)
    ]


def dashboard_problems(name: str, config: dict) -> list[str]:
    """The cloud head's dashboard runs jobs as the nodes' cloud identity: loopback only, or
    token auth explicitly on with the token in a file (never in argv)."""
    text = " ".join(config.get("head_start_ray_commands", []))
    hosts = re.findall(r"--dashboard-host[= ](\S+)", text)
    run_options = " ".join(
        config.get("docker", {}).get("run_options", [])
        + config.get("docker", {}).get("head_run_options", [])
    )
    token_on = "RAY_AUTH_MODE=token" in text + " " + run_options
    problems = []
    if "RAY_AUTH_TOKEN=" in text + run_options:
        problems.append(f"{name}: the Ray token is on a command line")
    if not hosts:
        problems.append(f"{name}: --dashboard-host not set explicitly")
    for host in hosts:
        if host not in ("127.0.0.1", "localhost") and not token_on:
            problems.append(f"{name}: dashboard on {host} without token auth")
    return problems


def _requirements(argv: list[str]) -> tuple[list[str], list[str]]:
    """`pip install` arguments -> (requirements, constraint files)."""
    reqs, constraints, skip = [], [], None
    for tok in argv:
        if skip:
            if skip in ("-c", "--constraint"):
                constraints.append(tok)
            skip = None
        elif tok in ("-c", "--constraint", "--index-url", "-i", "--extra-index-url", "-r"):
            skip = tok
        elif tok.startswith("-") and tok != "-e":
            continue
        elif tok != "-e":
            reqs.append(tok)
    return reqs, constraints


def pip_install_problems(where: str, text: str, constraint_files: dict[str, str]) -> list[str]:
    """Every `pip install` in text pins each requirement with ==, directly or through a -c file
    (given as {path in the command: its text}) of exact pins; `.` installs the project, whose
    dependencies must all be pinned there or by an earlier install of the same text."""
    problems, earlier = [], {}
    text = re.sub(r"\\\n", " ", text)  # continuation lines joined
    for m in re.finditer(r"pip install ([^;&|\n]*)", text):
        argv = shlex.split(m.group(1).replace("${", "{"))
        reqs, constraints = _requirements(argv)
        pinned = dict(earlier)
        for path in constraints:
            for line in constraint_files.get(path, "").splitlines():
                line = line.split("#")[0].strip()
                if line:
                    name, sep, ver = line.partition("==")
                    pinned[name.strip().lower()] = bool(sep and ver)
        if constraints and not pinned:
            problems.append(f"{where}: constraint file {constraints} unknown or empty")
        for req in reqs:
            if req == ".":
                deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
                for dep in deps["dependencies"]:
                    name = re.split(r"[\[<>=!~; ]", dep, maxsplit=1)[0].lower()
                    if "==" not in dep and not pinned.get(name):
                        problems.append(f"{where}: project dependency {dep!r} is not pinned")
            elif "==" not in req and not pinned.get(re.split(r"[\[<>=!~]", req)[0].lower()):
                problems.append(f"{where}: `pip install {req}` is not pinned (==)")
            elif "==" in req:
                earlier[re.split(r"[\[<>=!~]", req)[0].lower()] = True
    return problems


def static_key_problems(objects: list[dict]) -> list[str]:
    problems = []
    for where, template in pod_templates(objects):
        for c in containers(template):
            for name in STATIC_KEY_ENV & set(container_env(c)):
                problems.append(f"{where}/{c['name']}: static cloud credential {name} in env")
            for src in c.get("envFrom", []):
                problems.append(f"{where}/{c['name']}: envFrom {src} (keys may hide there)")
    accounts = {
        o["metadata"]["name"]: o.get("metadata", {}).get("annotations", {})
        for o in objects
        if o.get("kind") == "ServiceAccount"
    }
    for where, template in pod_templates(objects):
        if not where.startswith(("RayCluster", "RayJob")) or where.endswith("submitter"):
            continue
        account = template["spec"].get("serviceAccountName")
        if account not in accounts:
            problems.append(f"{where}: runs as {account!r}, not a ServiceAccount of deploy/")
            continue
        for key in IDENTITY_ANNOTATIONS:
            if not accounts[account].get(key):
                problems.append(f"{where}: ServiceAccount {account} lacks {key}")
    return problems


# --- the shipped files ----------------------------------------------------------------------


def _cloud(name: str) -> dict:
    (config,) = load_documents(CLOUD_DIR / name)
    return config


def test_every_pod_and_container_runs_unprivileged(kube_objects):
    assert security_context_problems(kube_objects) == []


def test_mlflow_is_reachable_only_from_ray_pods_and_the_labelled_ingress(kube_objects):
    assert network_policy_problems(kube_objects) == []


def test_ingress_label_is_the_one_the_readme_documents(readme_text):
    key, value = next(iter(INGRESS_LABEL.items()))
    assert f"{key}={value}" in readme_text


def test_mlflow_runs_with_basic_auth_and_no_secret_reaches_argv(kube_objects):
    assert mlflow_auth_problems(kube_objects) == []
    assert secret_in_argv_problems(kube_objects) == []


def test_every_image_is_pinned_by_digest_and_the_readme_substitutes_the_placeholder(
    kube_objects, readme_text
):
    images = kube_images(kube_objects)
    images += [(f"cloud/{n}", _cloud(n)["docker"]["image"]) for n in CLOUD_FILES]
    assert image_problems(images) == []
    if any(PLACEHOLDER_DIGEST in image for _, image in images):
        assert PLACEHOLDER_DIGEST in readme_text and "imagetools inspect" in readme_text, (
            "the manifests carry the placeholder digest: the README must say how to replace it"
        )


def test_cloud_dashboard_is_private_or_behind_token_auth():
    found = {n: dashboard_problems(n, _cloud(n)) for n in CLOUD_FILES}
    assert found == {n: [] for n in CLOUD_FILES}


def test_every_pip_install_is_pinned():
    files = {"/tmp/constraints.txt": CONSTRAINTS.read_text()}
    problems = pip_install_problems("Dockerfile", DOCKERFILE.read_text(), files)
    for n in CLOUD_FILES:
        config = _cloud(n)
        for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
            problems += pip_install_problems(f"{n} {key}", "\n".join(config.get(key, [])), {})
    assert problems == []


def test_ray_pods_use_workload_identity_and_no_static_keys(kube_objects):
    assert static_key_problems(kube_objects) == []


def test_checks_report_a_broken_copy(kube_objects):
    """Each check fires on a manifest set with one hole of its kind."""
    import copy

    broken = copy.deepcopy(kube_objects)
    mlflow = _only(broken, "Deployment", "mlflow")
    c = mlflow["spec"]["template"]["spec"]["containers"][0]
    del c["securityContext"]["allowPrivilegeEscalation"]
    c["args"] = [a for a in c["args"] if not a.startswith("--app-name")]
    c["args"].append("--backend-store-uri=postgresql://u:$(PGPASSWORD)@db/mlflow")
    c["image"] = "ghcr.io/your-org/elastic-fsdp:0.1.0"
    c["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "x"})
    policy = _only(broken, "NetworkPolicy", "mlflow-ingress")
    policy["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})
    assert "allowPrivilegeEscalation" in "\n".join(security_context_problems(broken))
    assert "neither the Ray pods" in "\n".join(network_policy_problems(broken))
    assert "basic-auth" in "\n".join(mlflow_auth_problems(broken))
    assert "$(PGPASSWORD)" in "\n".join(secret_in_argv_problems(broken))
    assert "not pinned by digest" in "\n".join(image_problems(kube_images(broken)))
    assert "AWS_SECRET_ACCESS_KEY" in "\n".join(static_key_problems(broken))
    cloud = _cloud("aws.yaml")
    cloud["head_start_ray_commands"] = ["ray start --head --dashboard-host=0.0.0.0"]
    assert "without token auth" in "\n".join(dashboard_problems("aws.yaml", cloud))
    assert "not pinned" in "\n".join(pip_install_problems("x", 'pip install "boto3>=1.26"', {}))
