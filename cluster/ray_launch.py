"""Ray for one job: connect (or start a local instance) and build the Train V2 TorchTrainer."""
from __future__ import annotations

import math
import os

from trainer.config import ClusterConfig, JobConfig


def ray_address(cluster: ClusterConfig) -> str | None:
    """cluster.address, else RAY_ADDRESS (set by `ray job submit`), else None: start locally."""
    return cluster.address or os.environ.get("RAY_ADDRESS") or None


def local_num_cpus(cluster: ClusterConfig) -> int:
    """Just enough logical CPUs for the largest worker group, plus one for Ray's own actors."""
    return math.ceil(cluster.world_sizes[1] * cluster.cpus_per_worker) + 1


def connect(cluster: ClusterConfig) -> None:
    """ray.init once per process; later jobs of a Hydra multirun reuse the same Ray.

    A local instance keeps its dashboard process: it serves the State API, without which
    Ray Train's placement-group cleaner cannot see its controller and warns every second.
    """
    import ray

    if ray.is_initialized():
        return
    # Ray Train V2 routes worker print() through its logger and, when stdout is wrapped, also
    # to stdout: every step line would show twice. Ray propagates this to the workers.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    address = ray_address(cluster)
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=local_num_cpus(cluster), include_dashboard=True)


def build_trainer(cfg: JobConfig, train_loop_config: dict):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from cluster.worker import train_loop_per_worker

    c = cfg.cluster
    lo, hi = c.world_sizes
    resources = {"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=train_loop_config,
        scaling_config=ScalingConfig(num_workers=hi if c.min_workers is None else (lo, hi),
                                     use_gpu=c.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=c.run_name,
            storage_path=c.storage_path,
            failure_config=FailureConfig(max_failures=c.max_failures),
            # Applies to Ray's pointer folders only (cluster/ray_checkpoint.py); the loop prunes
            # the real checkpoints with the same count.
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
        ),
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo",
                                 timeout_s=int(math.ceil(c.pg_timeout_s))),
    )
