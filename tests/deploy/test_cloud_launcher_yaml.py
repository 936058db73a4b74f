"""deploy/cloud/*.yaml: Ray cluster launcher configs with GPU worker types, checked offline.

Ray's own validation runs first (the JSON schema `ray up` applies, after merging the provider's
defaults); then what this project needs of them: a CPU-only head, GPU worker types with
min/max bounds that fit the cluster's max_workers, and the project image with the GPUs passed in.
"""

from __future__ import annotations

import copy

import pytest
from deploy_helpers import CLOUD_DIR, load_documents

PROVIDERS = {"aws.yaml": "aws", "gcp.yaml": "gcp"}
REQUIRED = ("cluster_name", "max_workers", "provider", "available_node_types", "head_node_type")


def _config(name: str) -> dict:
    (config,) = load_documents(CLOUD_DIR / name)
    return config


def launcher_problems(config: dict) -> list[str]:
    """What the launcher and an elastic GPU run need of one config; empty when all is there."""
    problems = [f"{key} missing" for key in REQUIRED if key not in config]
    if problems:
        return problems
    types = config["available_node_types"]
    head = config["head_node_type"]
    if head not in types:
        return [f"head_node_type {head!r} is not one of {sorted(types)}"]
    if types[head].get("resources", {}).get("GPU", 0) != 0:
        problems.append(f"head type {head!r} advertises GPUs; the head must have none")
    workers = {k: v for k, v in types.items() if k != head}
    gpu_types = {k: v for k, v in workers.items() if v.get("resources", {}).get("GPU", 0) >= 1}
    if not gpu_types:
        problems.append("no worker node type with a GPU")
    for name, node in workers.items():
        for key in ("min_workers", "max_workers", "resources", "node_config"):
            if key not in node:
                problems.append(f"{name}: {key} missing")
        lo, hi = node.get("min_workers", 0), node.get("max_workers", 0)
        if not 0 <= lo <= hi <= config["max_workers"]:
            problems.append(
                f"{name}: needs 0 <= min_workers <= max_workers <= {config['max_workers']}, "
                f"got {lo}..{hi}"
            )
    if sum(n.get("min_workers", 0) for n in workers.values()) > config["max_workers"]:
        problems.append("the node types' min_workers add up to more than max_workers")
    if not any(n.get("max_workers", 0) > n.get("min_workers", 0) for n in gpu_types.values()):
        problems.append("no GPU type can grow: the elastic run would have nothing to grow into")
    head_start = " ".join(config.get("head_start_ray_commands", []))
    if (
        "--num-gpus=0" not in head_start
        or "--autoscaling-config=~/ray_bootstrap_config.yaml" not in head_start
    ):
        problems.append(
            "head_start_ray_commands must start Ray with --num-gpus=0 and the autoscaling config"
        )
    if "--gpus all" not in config.get("docker", {}).get("worker_run_options", []):
        problems.append("docker.worker_run_options must pass the GPUs in (--gpus all)")
    return problems


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_ray_accepts_the_cluster_config(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _config(name)
    assert config["provider"]["type"] == PROVIDERS[name]
    validate_config(copy.deepcopy(config))
    validate_config(
        prepare_config(copy.deepcopy(config))
    )  # what `ray up` does after merging defaults


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_cluster_config_has_gpu_workers_a_cpu_head_and_the_project_image(name, project_image):
    config = _config(name)
    assert launcher_problems(config) == []
    assert config["docker"]["image"] == project_image


def test_launcher_check_reports_broken_configs():
    config = _config("aws.yaml")
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_1x"]["max_workers"] = bad["max_workers"] + 1
    del bad["available_node_types"]["gpu_8x"]["min_workers"]
    bad["available_node_types"][bad["head_node_type"]]["resources"]["GPU"] = 1
    problems = "\n".join(launcher_problems(bad))
    assert "gpu_1x: needs 0 <= min_workers <= max_workers" in problems
    assert "gpu_8x: min_workers missing" in problems
    assert "advertises GPUs" in problems
    del bad["head_node_type"]
    assert launcher_problems(bad) == ["head_node_type missing"]
