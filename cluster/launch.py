"""Ray for one job: connect (or start a local instance) and build the Train V2 TorchTrainer."""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

from cluster.config import ClusterConfig, JobConfig
from cluster.elastic import spares
from cluster.elastic.grow import GrowDrain
from cluster.logs import NEVER_DEDUP, quiet_ray_driver, ray_train_logging
from cluster.run.folder import RunFolder
from cluster.worker import train_loop_per_worker


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
    # before Ray is imported: it reads this once (cluster/logs.py NEVER_DEDUP says why)
    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", NEVER_DEDUP)
    import ray  # noqa: PLC0415 -- ray costs seconds to import: not for a config that fails

    if ray.is_initialized():
        return
    # Ray Train V2 routes worker print() through its logger and, when stdout is wrapped, also
    # to stdout: every step line would show twice. Ray propagates this to the workers.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    quiet_ray_driver(cluster.verbose)
    address = ray_address(cluster)
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=local_num_cpus(cluster), include_dashboard=True)


def connect_largest(cfgs: list[JobConfig]) -> None:
    """Start or join Ray once for all these jobs (a sweep's, or a plain run's one), sized for the
    largest (a local Ray started for a 2-worker job would leave a later 4-worker job waiting for
    CPUs forever); exit 1 if Ray cannot be reached."""
    largest = max(cfgs, key=lambda c: local_num_cpus(c.cluster))
    try:
        connect(largest.cluster)
    except ConnectionError as e:
        print(
            f"error: cannot reach Ray (cluster.address={largest.cluster.address!r}, "
            f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}): {e}",
            file=sys.stderr,
        )
        sys.exit(1)


HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
HEALTH_CHECK_OURS = "ELASTIC_FSDP_SET_HEALTH_CHECK_INTERVAL"
"""The value we set RAY_TRAIN_HEALTH_CHECK_INTERVAL_S to (cluster.health_check_interval_s). A
process started from this one (a test that built a trainer, then launched the CLI; a sweep's
next job) inherits both and, while they agree, applies its own config instead of taking the
inherited value for the user's (what happened with the preemption watcher's switch). A value
that differs from it was set by someone else since: the user's."""


def set_health_check_interval(seconds: float) -> Optional[str]:
    """Ray Train reads its controller's poll interval from the driver's environment (and hands it
    to the controller): set it to `seconds` unless the user set it. Returns the value in force."""
    current = os.environ.get(HEALTH_CHECK_ENV)
    if current is not None and current != os.environ.get(HEALTH_CHECK_OURS):
        return current
    os.environ[HEALTH_CHECK_ENV] = os.environ[HEALTH_CHECK_OURS] = f"{seconds:g}"
    return os.environ[HEALTH_CHECK_ENV]


def build_trainer(cfg: JobConfig, train_loop_config: dict):
    """The TorchTrainer of one run: fixed or elastic (min..max workers), restarted on failures.

    Every (re)start of the worker group resumes from the run's newest checkpoint at the group's
    size. A stable name + storage makes a resubmitted run the same run: Ray finds its reported
    checkpoints, the loop its checkpoint folder."""
    import ray.train.torch  # noqa: PLC0415 -- ray costs seconds to import: only to run a job

    from cluster.elastic.clock import RestartClock  # noqa: PLC0415 -- imports Ray Train
    from cluster.elastic.cluster_view import ClusterView  # noqa: PLC0415 -- the same
    from cluster.elastic.drain import SigtermCallback  # noqa: PLC0415 -- the same
    from cluster.elastic.preemption import replace_rays_watcher  # noqa: PLC0415 -- the same

    c = cfg.cluster
    preemption = replace_rays_watcher()  # Ray's own logs an ERROR line at every group start
    set_health_check_interval(c.health_check_interval_s)
    lo, hi = c.world_sizes
    elastic = c.min_workers is not None
    resources = {"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})}
    # the running group checkpoints before Ray grows it (the controller reaches the run folder)
    folder = RunFolder.of_run(c)
    launch_id = train_loop_config.get("launch", {}).get("launch_id", "")
    grow = GrowDrain(folder, c.drain_on_grow_timeout_s, launch_id=launch_id)
    scaling = ray.train.ScalingConfig(
        num_workers=(lo, hi) if elastic else hi,
        use_gpu=c.use_gpu,
        resources_per_worker=resources,
        elastic_resize_monitor_interval_s=c.elastic_resize_monitor_interval_s,
    )
    return ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config=train_loop_config,
        scaling_config=scaling,
        run_config=ray.train.RunConfig(
            name=c.run_name,
            storage_path=c.storage_path,
            # Each worker death, node loss or graceful drain (the drained group raises
            # cluster.elastic.drain.DrainedError so that Ray restarts it) counts one failure.
            failure_config=ray.train.FailureConfig(max_failures=c.max_failures),
            # Applies to Ray's pointer folders only (cluster/run/ray_checkpoint.py); the loop prunes
            # the real checkpoints with the same count.
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            callbacks=[SigtermCallback(), RestartClock(folder, launch_id)]
            + ([preemption] if preemption else [])
            + ([ClusterView(c.elastic_resize_monitor_interval_s, lo, grow)] if elastic else []),
            # Ray Train's INFO lines (one per report per rank among them) only when verbose
            logging_config=ray_train_logging(c.verbose),
            # every worker process runs spares.preload: it warms the spares (elastic/spares.py)
            worker_runtime_env=spares.worker_runtime_env() if c.spares_on else None,
        ),
        torch_config=ray.train.torch.TorchConfig(
            backend="nccl" if c.use_gpu else "gloo", timeout_s=int(math.ceil(c.pg_timeout_s))
        ),
    )
