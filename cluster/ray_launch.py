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
    """The TorchTrainer of one run: fixed or elastic (min..max workers), restarted on failures.

    Every (re)start of the worker group resumes from the run's newest checkpoint at the group's
    size. A stable name + storage makes a resubmitted run the same run: Ray finds its reported
    checkpoints, the loop its checkpoint folder."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from cluster.elastic import ClusterView, SigtermCallback
    from cluster.worker import train_loop_per_worker

    c = cfg.cluster
    lo, hi = c.world_sizes
    elastic = c.min_workers is not None
    resources = {"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=train_loop_config,
        scaling_config=ScalingConfig(num_workers=(lo, hi) if elastic else hi,
                                     use_gpu=c.use_gpu, resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=c.elastic_resize_monitor_interval_s),
        run_config=RunConfig(
            name=c.run_name,
            storage_path=c.storage_path,
            # Each worker death, node loss or graceful drain (the drained group raises
            # cluster.elastic.DrainedError so that Ray restarts it) counts one failure.
            failure_config=FailureConfig(max_failures=c.max_failures),
            # Applies to Ray's pointer folders only (cluster/ray_checkpoint.py); the loop prunes
            # the real checkpoints with the same count.
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            callbacks=[SigtermCallback()] + (
                [ClusterView(c.elastic_resize_monitor_interval_s, lo)] if elastic else []),
        ),
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo",
                                 timeout_s=int(math.ceil(c.pg_timeout_s))),
    )
