"""What each Ray Train worker runs: rebuild the job, adapt Ray's context to trainer.loop, train.

Ray Train's TorchTrainer has already joined this process to the default torch.distributed group
(gloo on CPU, NCCL on GPU) before this function starts. Every start of the worker group (the
first, and each restart after a failure or a resize) runs this function again at the group's
world size; the loop resumes from the newest checkpoint, and cluster/elastic/ adds the fault
drills, the graceful drain (and how the group then leaves) and the elastic/* metrics.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from cluster.config import job_from_dict, snapshots_on
from cluster.elastic.grow import DrainRequests
from cluster.elastic.spares import (
    SpareRequest,
    match_torch_threads,
    record_worker_env,
    this_process,
)
from cluster.logs import end_of_output, quiet_libraries, quiet_ray_worker
from cluster.run.fatal import end_fatally, fatal_errors
from cluster.run.folder import RunFolder, ray_run_folder
from cluster.run.lease import LeaseGuard
from cluster.run.ray_checkpoint import read_pointer, report_checkpoint
from cluster.run.reporter import Reporter
from trainer.metrics import MetricsLogger, MLflowLogger, NodeMetrics, NullLogger, print0


@dataclass
class LaunchInfo:
    """What the driver decided at launch, besides the config itself."""

    checkpoint_root: str
    """Where this run's checkpoints live: <storage_path>/<run_name>/checkpoints."""
    mlflow_run_id: Optional[str] = None
    """The run the driver created; None when tracking is disabled."""
    data_dir: Optional[str] = None
    """The prepared dataset the driver prepared (or found) for this run."""
    launch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """One per launch of the run (each `fit`): worker-group restarts are counted within it."""
    startup: Optional[dict] = None
    """The driver's start-up phases (cluster/train.py Startup.handed_over): rank 0 of the
    launch's first worker group prints them with its own when its first step is done."""
    previous_launch_id: Optional[str] = None
    """The run's previous launch when it died without ending (its lease taken over, not
    released: a killed driver). Its snapshot keepers (detached) still hold its newest state:
    the resume reads them too, and this launch stops them once its own state is committed."""


REPORT_SLOW_S = 10.0
"""A checkpoint report Ray Train has not taken within this long is logged (run/reporter.py)."""
REPORT_FLUSH_S = 60.0
"""At a normal end, how long the worker waits for Ray to take its last reports."""


def worker_config(job: dict, launch: LaunchInfo) -> dict:
    """TorchTrainer's train_loop_config: plain builtins only."""
    return {"job": job, "launch": asdict(launch)}


def assigned_device(use_gpu: bool):
    """The GPU Ray assigned to this worker (Ray knows which visible GPU is whose); None on CPU
    workers, where the loop's resolver (trainer/device.py) decides from cfg.train.device."""
    if not use_gpu:
        return None
    import ray.train.torch  # noqa: PLC0415 -- GPU workers only

    return ray.train.torch.get_device()


def spare_request(cfg) -> Optional[Callable[[int], None]]:
    """Each worker: a spare process on its node after the first step (elastic/spares.py)."""
    return SpareRequest() if cfg.cluster.spares_on else None


def train_loop_per_worker(config: dict) -> None:
    entered = time.time()
    # The driver imports this module too, and must not pay for ray and Ray Train (seconds)
    # before a config is checked; here the imports are timed (ElasticTracker's imports_s).
    import ray.train  # noqa: PLC0415 -- ray: seconds to import, and timed here

    from cluster.elastic.drain import (  # noqa: PLC0415 -- imports Ray Train
        WORKER_TIMES,
        DrainWatcher,
        preemption_notice,
        training,
    )
    from cluster.elastic.faults import FaultInjector  # noqa: PLC0415 -- the same
    from cluster.elastic.leave import leave_gracefully  # noqa: PLC0415 -- the same
    from cluster.elastic.tracker import ElasticTracker, chain  # noqa: PLC0415 -- the same
    from trainer.loop import WorkerContext, run_training  # noqa: PLC0415 -- the whole trainer

    match_torch_threads()  # a spare imported torch before Ray set OMP_NUM_THREADS
    cfg = job_from_dict(config["job"])
    quiet_libraries(cfg.cluster.verbose)  # per process: the driver's setting does not reach here
    quiet_ray_worker(cfg.cluster.verbose)
    launch = LaunchInfo(**config["launch"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    folder = RunFolder.of_ray_run(context.get_storage())
    logger = make_logger(rank, cfg.tracking.tracking_uri, launch.mlflow_run_id)
    times = {
        "context": WORKER_TIMES.get("context"),
        "entered": entered,
        "imported": time.time(),
    }
    tracker = ElasticTracker(
        folder,
        rank,
        world_size,
        launch.launch_id,
        times,
        startup=launch.startup,
        process=this_process(),
    )
    node_metrics = system_metrics(context, cfg, launch)
    drain = DrainWatcher(
        rank,
        preemption_info=preemption_notice(),
        requests=DrainRequests(folder, launch.launch_id) if rank == 0 else None,
    )
    announce_resume(ray.train.get_checkpoint())
    reporter = Reporter(report_checkpoint, slow_s=REPORT_SLOW_S)  # never blocks the loop
    if rank == 0 and cfg.cluster.spares_on:  # the controller starts spares on joined nodes
        record_worker_env(folder, launch.launch_id)
    ctx = WorkerContext(
        rank=rank,
        world_size=world_size,
        local_rank=context.get_local_rank(),
        local_world_size=context.get_local_world_size(),
        checkpoint_root=launch.checkpoint_root,
        data_dir=launch.data_dir,
        # The loop takes the newest valid checkpoint in checkpoint_root itself. That is never
        # older than Ray's latest report (a checkpoint is committed before it is reported) and
        # is newer when a worker died between commit and report, so Ray's is not passed here.
        resume_from=None,
        on_checkpoint=reporter.report,
        should_stop=drain,
        logger=logger,
        device=assigned_device(cfg.cluster.use_gpu),
        before_step=chain(
            tracker.before_step,
            FaultInjector(cfg.fault, rank, folder),
            spare_request(cfg),
        ),
        after_step=after_steps(tracker.on_step, node_metrics and node_metrics.on_step),
        may_write=LeaseGuard(ray_run_folder(context.get_storage()), launch.launch_id),
        snapshot_root=snapshot_root(cfg, launch),
        inherited_snapshots=inherited_snapshots(cfg, launch),
        release_inherited=release_inherited(cfg, launch) if rank == 0 else None,
    )
    try:
        with training():
            result = run_training(cfg, ctx)
    except fatal_errors() as e:
        reporter.drop()
        end_fatally(folder, rank, launch.launch_id, e)
        if rank == 0:  # the driver waits for this line
            print(end_of_output(launch.launch_id), flush=True)
        return
    finally:
        logger.close()
        if node_metrics is not None:
            node_metrics.finish()
    if result.steps_done >= cfg.train.steps:
        reporter.flush(REPORT_FLUSH_S)  # Ray's record of the last checkpoint, before the end
    else:  # leaving: the next group resumes from the run folder, not from Ray's record
        reporter.drop()
    if rank == 0 and result.steps_done >= cfg.train.steps:  # the driver waits for this line
        if drain.requests is not None:
            drain.requests.finished(result.steps_done)
        print(end_of_output(launch.launch_id), flush=True)
    if result.steps_done < cfg.train.steps:  # the loop only returns early when asked to stop
        leave_gracefully(
            drain,
            tracker,
            rank,
            world_size,
            result.steps_done,
            cfg.train.steps,
            result.last_checkpoint,
            stop_keeper=stop_node_keeper(cfg, launch) if ctx.snapshot_root else None,
        )


def system_metrics(context, cfg, launch: LaunchInfo) -> Optional[NodeMetrics]:
    """MLflow system metrics of this node (system/<node ip>/...), from its local rank 0 only;
    the node of global rank 0 tags the run with the sampling chosen (trainer.metrics)."""
    if context.get_local_rank() != 0 or not launch.mlflow_run_id:
        return None
    import ray  # noqa: PLC0415 -- ray: seconds to import; loaded already in a worker

    return NodeMetrics(
        cfg.tracking.tracking_uri,
        launch.mlflow_run_id,
        node_id=ray.util.get_node_ip_address(),
        total_steps=cfg.train.steps,
        interval_s=cfg.tracking.system_metrics_interval_s,
        tag=context.get_world_rank() == 0,
    )


def snapshot_root(cfg, launch: LaunchInfo) -> Optional[str]:
    """Where this launch's in-memory snapshots go: keeper://, the memory of a keeper actor per
    node, each file on its writer's node and the next (cluster/snapshots/); this node's keeper
    is started here if no worker started it yet. None when snapshots are off (`snapshots_on`)."""
    if not snapshots_on(cfg):
        return None
    import ray  # noqa: PLC0415 -- ray: seconds to import; loaded already in a worker

    from cluster.snapshots import keeper_fs, keepers  # noqa: PLC0415 -- imports ray

    keeper_fs.register_keeper_scheme()
    key = keepers.run_key_of(cfg.cluster.run_name, launch.launch_id)
    keepers.ensure_keeper(key, ray.get_runtime_context().get_node_id())
    return keeper_fs.snapshots_url(key)


def inherited_snapshots(cfg, launch: LaunchInfo) -> Optional[str]:
    """The previous launch's snapshot root when it died without ending (LaunchInfo
    .previous_launch_id), for the resume to read; None otherwise or with snapshots off."""
    if not snapshots_on(cfg) or not launch.previous_launch_id:
        return None
    from cluster.snapshots import keeper_fs, keepers  # noqa: PLC0415 -- imports ray

    previous = keepers.run_key_of(cfg.cluster.run_name, launch.previous_launch_id)
    return keeper_fs.snapshots_url(previous)  # snapshot_root registered the scheme


def release_inherited(cfg, launch: LaunchInfo) -> Optional[Callable[[], None]]:
    """What stops the previous launch's keepers (and frees the memory of its snapshots) once
    this launch's own first snapshot or checkpoint is committed."""
    if not snapshots_on(cfg) or not launch.previous_launch_id:
        return None
    from cluster.snapshots import keepers  # noqa: PLC0415 -- imports ray

    previous = launch.previous_launch_id
    key = keepers.run_key_of(cfg.cluster.run_name, previous)

    def release() -> None:
        stopped = keepers.stop_keepers(key)
        if stopped:
            print0(
                f"snapshots: stopped the {len(stopped)} keeper(s) of the previous launch "
                f"{previous} (this launch's own state is committed): their memory is free"
            )

    return release


def stop_node_keeper(cfg, launch: LaunchInfo) -> Callable[[], None]:
    """What stops this node's keeper when its node leaves (elastic/leave.py calls it)."""
    from cluster.snapshots import keepers  # noqa: PLC0415 -- imports ray

    key = keepers.run_key_of(cfg.cluster.run_name, launch.launch_id)
    return lambda: keepers.stop_node_keeper(key)


def after_steps(*hooks) -> Callable[[int, dict], Optional[dict]]:
    """One WorkerContext.after_step from the tracker's and the node metrics' (None skipped):
    the metrics the hooks return, merged."""
    active = [h for h in hooks if h is not None]

    def after_step(step: int, metrics: dict) -> Optional[dict]:
        out: dict = {}
        for hook in active:
            out.update(hook(step, metrics) or {})
        return out

    return after_step


def make_logger(rank: int, tracking_uri: str, run_id: Optional[str]) -> MetricsLogger:
    if rank == 0 and run_id:
        return MLflowLogger(tracking_uri, run_id)
    return NullLogger()


def announce_resume(ray_checkpoint) -> None:
    pointer = read_pointer(ray_checkpoint)
    if pointer:
        print0(
            f"Ray's latest reported checkpoint: step {pointer['step']} at {pointer['checkpoint']}"
        )
