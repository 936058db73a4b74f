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

from cluster.config import job_from_dict
from cluster.elastic.spares import match_torch_threads
from cluster.logs import end_of_output, quiet_libraries, quiet_ray_worker
from cluster.run.fatal import end_fatally, fatal_errors
from cluster.run.folder import RunFolder
from cluster.run.layout import ray_run_folder
from cluster.run.lease import LeaseGuard
from cluster.run.ray_checkpoint import read_pointer, report_checkpoint
from cluster.run.reporter import Reporter
from cluster.snapshots.lifecycle import LaunchSnapshots
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


def train_loop_per_worker(config: dict) -> None:
    entered = time.time()
    # The driver imports this module too, and must not pay for ray and Ray Train (seconds)
    # before a config is checked; here the imports are timed (ElasticTracker's imports_s).
    import ray.train  # noqa: PLC0415 -- ray: seconds to import, and timed here

    from cluster.elastic.drain import training  # noqa: PLC0415 -- imports Ray Train
    from cluster.elastic.hooks import WorkerHooks  # noqa: PLC0415 -- the same
    from trainer.loop import run_training  # noqa: PLC0415 -- the whole trainer

    match_torch_threads()  # a spare imported torch before Ray set OMP_NUM_THREADS
    cfg, launch = job_from_dict(config["job"]), LaunchInfo(**config["launch"])
    quiet_libraries(cfg.cluster.verbose)  # per process: the driver's setting does not reach here
    quiet_ray_worker(cfg.cluster.verbose)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    folder = RunFolder.of_ray_run(context.get_storage())
    logger = make_logger(rank, cfg.tracking.tracking_uri, launch.mlflow_run_id)
    hooks = WorkerHooks(cfg, folder, rank, world_size, launch.launch_id, entered, launch.startup)
    node_metrics = system_metrics(context, cfg, launch)
    announce_resume(ray.train.get_checkpoint())
    reporter = Reporter(report_checkpoint, slow_s=REPORT_SLOW_S)  # never blocks the loop
    snapshots = LaunchSnapshots.of(cfg, launch.launch_id, launch.previous_launch_id)
    ctx = worker_context(cfg, launch, context, hooks, snapshots, reporter, logger, node_metrics)
    try:
        with training():
            result = run_training(cfg, ctx)
    except fatal_errors() as e:  # a retry would repeat it: the launch ends (run/fatal.py)
        end_for_good(folder, rank, launch.launch_id, reporter, e)
        return
    finally:
        logger.close()
        if node_metrics is not None:
            node_metrics.finish()
    if result.steps_done < cfg.train.steps:  # the loop only returns early when asked to stop
        reporter.drop()  # the next group resumes from the run folder, not from Ray's record
        stop_keeper = snapshots.stop_node_keeper()
        hooks.leave(result.steps_done, cfg.train.steps, result.last_checkpoint, stop_keeper)
        return  # (not reached: leave ends the process or raises DrainedError)
    reporter.flush(REPORT_FLUSH_S)  # Ray's record of the last checkpoint, before the end
    if rank == 0:  # the driver waits for this line
        hooks.finished(result.steps_done)
        print(end_of_output(launch.launch_id), flush=True)


def end_for_good(folder: RunFolder, rank: int, launch_id: str, reporter, error) -> None:
    """The training failed in a way no restart would mend: no more reports to Ray, the error
    recorded for the driver (end_fatally), and rank 0's last line, which the driver waits for."""
    reporter.drop()
    end_fatally(folder, rank, launch_id, error)
    if rank == 0:
        print(end_of_output(launch_id), flush=True)


def worker_context(cfg, launch: LaunchInfo, context, hooks, snapshots, reporter, logger, metrics):
    """What the loop is told (trainer.loop.WorkerContext): who this rank is, where the launch
    reads and writes (its checkpoints, its snapshots and the dead previous launch's, Ray's
    report of each commit, the run lease), and the elastic hooks (cluster/elastic/hooks.py)."""
    from trainer.loop import WorkerContext  # noqa: PLC0415 -- the whole trainer, timed above

    rank = context.get_world_rank()
    return WorkerContext(
        rank=rank,
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        local_world_size=context.get_local_world_size(),
        checkpoint_root=launch.checkpoint_root,
        data_dir=launch.data_dir,
        # The loop takes the newest valid checkpoint in checkpoint_root itself. That is never
        # older than Ray's latest report (a checkpoint is committed before it is reported) and
        # is newer when a worker died between commit and report, so Ray's is not passed here.
        resume_from=None,
        on_checkpoint=reporter.report,
        should_stop=hooks.drain,
        logger=logger,
        device=assigned_device(cfg.cluster.use_gpu),
        before_step=hooks.before_step,
        after_step=after_steps(hooks.on_step, metrics and metrics.on_step),
        may_write=LeaseGuard(ray_run_folder(context.get_storage()), launch.launch_id),
        snapshot_root=snapshots.root(),
        inherited_snapshots=snapshots.inherited_root(),
        release_inherited=snapshots.release_inherited() if rank == 0 else None,
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
