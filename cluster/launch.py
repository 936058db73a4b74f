"""Ray for one job: join the cluster (or start a local instance), check it holds the job, and
build the Train V2 TorchTrainer.

    connect_for_jobs([cfg])          # join or start Ray; exit 1 if it cannot hold the job
    trainer = build_trainer(cfg, worker_config(...))
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from typing import Optional

from cluster.address import NoCluster, join_address, joins_cluster
from cluster.capacity import Capacity, Request, worker_resources
from cluster.config import ClusterConfig, JobConfig
from cluster.elastic import spares
from cluster.logs import NEVER_DEDUP, plain_ray_console, quiet_ray_driver, ray_train_logging
from cluster.run.folder import RunFolder
from cluster.tracking.source import COMMIT_ENV, source_tags
from cluster.worker import train_loop_per_worker
from trainer.shell import python_m


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
    plain_ray_console()
    address = join_address(cluster)
    if address:
        set_api_server(None)
        ray.init(address=address)
        return
    port = free_port()
    set_api_server(f"http://127.0.0.1:{port}")
    ray.init(num_cpus=local_num_cpus(cluster), include_dashboard=True, dashboard_port=port)
    print(f"ray: started a local Ray for this job (dashboard http://127.0.0.1:{port})", flush=True)


API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"
API_SERVER_OURS = "ELASTIC_FSDP_SET_API_SERVER_ADDRESS"


def set_api_server(url: Optional[str]) -> None:
    """Point Ray's State API clients at the local Ray's dashboard (`url`), or at nothing of ours
    (None, when joining a cluster), unless the user set RAY_API_SERVER_ADDRESS. Ray's helper
    actors (its placement-group cleaner, which polls the State API every second) find it on
    "auto", which picks any Ray on the machine; the raylet hands this variable to every worker
    it starts, so they ask this run's. Like HEALTH_CHECK_OURS below: a value inherited from a
    process that set it (a test, a sweep's driver) is ours to replace."""
    current = os.environ.get(API_SERVER_ENV)
    if current is not None and current != os.environ.get(API_SERVER_OURS):
        return
    if url is None:
        os.environ.pop(API_SERVER_ENV, None)
        os.environ.pop(API_SERVER_OURS, None)
    else:
        os.environ[API_SERVER_ENV] = os.environ[API_SERVER_OURS] = url


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the local Ray's dashboard)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_largest(cfgs: list[JobConfig]) -> None:
    """Start or join Ray once for all these jobs (a sweep's, or a plain run's one), sized for the
    largest (a local Ray started for a 2-worker job would leave a later 4-worker job waiting for
    CPUs forever); exit 1 if Ray cannot be reached."""
    largest = max(cfgs, key=lambda c: local_num_cpus(c.cluster))
    try:
        connect(largest.cluster)
    except NoCluster as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except ConnectionError as e:
        print(
            f"error: cannot reach Ray (cluster.address={largest.cluster.address!r}, "
            f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}): {e}",
            file=sys.stderr,
        )
        sys.exit(1)


def connect_for_jobs(cfgs: list[JobConfig]) -> None:
    """connect_largest, then check that the cluster holds every job's workers (or its
    autoscaler can add what they lack, cluster/capacity.py): exit 1 with one error naming the
    request, the cluster and the keys to change, within seconds, instead of waiting forever."""
    connect_largest(cfgs)
    address = connected_address()
    started = not joins_cluster(cfgs[0].cluster)
    capacity = Capacity.of_ray(f"{address} (a local Ray started here)" if started else address)
    for cfg in cfgs:
        request = Request.of(cfg.cluster)
        problem = request.infeasible(capacity)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(1)
    largest = max(cfgs, key=lambda c: c.cluster.world_sizes[1])
    note = Request.of(largest.cluster).waits_for(capacity)
    if note:
        print(note, flush=True)


def connected_address() -> str:
    """The GCS address of the Ray this process is connected to ('?' where Ray does not say: a
    Ray Client connection)."""
    import ray  # noqa: PLC0415 -- connected: imported already

    try:
        return ray.get_runtime_context().gcs_address or "?"
    except Exception:
        return "?"


JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor for a driver it runs (`ray job submit`): the job's runtime env and
metadata, its submission id among them (ray/dashboard/modules/job/job_supervisor.py)."""


def ray_job_tags() -> dict[str, str]:
    """MLflow tags naming the Ray job of this driver, however it was launched: `ray.job_id`
    (Ray's own job id, also of a plain `python -m cluster.train`), `ray.address`, and under
    `ray job submit` `ray.submission_id` (what `ray job logs/status/stop` take) and
    `ray.working_dir` (the uploaded package). Where the code's commit is unknown (`ray job
    submit` uploads no .git), `git_commit` says so and how to record it."""
    import ray  # noqa: PLC0415 -- connected: imported already

    tags = {
        "ray.job_id": ray.get_runtime_context().get_job_id(),
        "ray.address": connected_address(),
    }
    try:
        submitted = json.loads(os.environ.get(JOB_CONFIG_ENV) or "{}")
    except ValueError:
        submitted = {}
    submission_id = (submitted.get("metadata") or {}).get("job_submission_id")
    working_dir = (submitted.get("runtime_env") or {}).get("working_dir")
    if submission_id:
        tags["ray.submission_id"] = submission_id
    if working_dir:
        tags["ray.working_dir"] = str(working_dir)
    if submission_id and "mlflow.source.git.commit" not in source_tags():
        tags["git_commit"] = (
            f"unknown: `ray job submit` uploaded {working_dir or 'the code'} without .git and "
            f"without {COMMIT_ENV}; submit with {python_m('cluster.submit')} to record the commit"
        )
    return tags


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

    from cluster.elastic.callbacks import ray_callbacks  # noqa: PLC0415 -- imports Ray Train

    c = cfg.cluster
    set_health_check_interval(c.health_check_interval_s)
    lo, hi = c.world_sizes
    folder = RunFolder.of_run(c)
    launch_id = train_loop_config.get("launch", {}).get("launch_id", "")
    callbacks = ray_callbacks(c, folder, launch_id)  # the elastic parts (cluster/elastic/)
    scaling = ray.train.ScalingConfig(
        num_workers=(lo, hi) if c.elastic else hi,
        use_gpu=c.use_gpu,
        resources_per_worker=worker_resources(c),
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
            callbacks=callbacks,
            # Ray Train's INFO lines (one per report per rank among them) only when verbose
            logging_config=ray_train_logging(c.verbose),
            # every worker process runs spares.preload: it warms the spares (elastic/spares.py)
            worker_runtime_env=spares.worker_runtime_env(str(folder.location))
            if c.spares_on
            else None,
        ),
        torch_config=ray.train.torch.TorchConfig(
            backend="nccl" if c.use_gpu else "gloo", timeout_s=int(math.ceil(c.pg_timeout_s))
        ),
    )
