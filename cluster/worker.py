"""What each Ray Train worker runs: rebuild the job, adapt Ray's context to trainer.loop, train.

Ray Train's TorchTrainer has already joined this process to the default torch.distributed group
(gloo on CPU, NCCL on GPU) before this function starts. Every start of the worker group (the
first, and each restart after a failure or a resize) runs this function again at the group's
world size; the loop resumes from the newest checkpoint, and cluster/elastic/ adds the fault
drills, the graceful drain and the elastic/* metrics.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from cluster.config import job_from_dict, run_folder
from cluster.lease import LeaseGuard
from cluster.logs import end_of_output, quiet_libraries, quiet_ray_worker
from cluster.ray_checkpoint import read_pointer, report_checkpoint
from cluster.spares import SpareRequest, match_torch_threads, this_process
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
    """Each worker: a spare process on its node after the first step (cluster/spares.py)."""
    return SpareRequest() if cfg.cluster.spares_on else None


def train_loop_per_worker(config: dict) -> None:
    entered = time.time()
    # The driver imports this module too, and must not pay for ray and torch (seconds) before a
    # config is checked; here the imports are timed (ElasticTracker's imports_s).
    import ray.train  # noqa: PLC0415 -- ray: seconds to import, and timed here

    from cluster import elastic  # noqa: PLC0415 -- imports ray
    from trainer.loop import WorkerContext, run_training  # noqa: PLC0415 -- imports torch

    match_torch_threads()  # a spare imported torch before Ray set OMP_NUM_THREADS
    cfg = job_from_dict(config["job"])
    quiet_libraries(cfg.cluster.verbose)  # per process: the driver's setting does not reach here
    quiet_ray_worker(cfg.cluster.verbose)
    launch = LaunchInfo(**config["launch"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    folder = elastic.RunFolder.of_ray_run(context.get_storage())
    logger = make_logger(rank, cfg.tracking.tracking_uri, launch.mlflow_run_id)
    times = {
        "context": elastic.WORKER_TIMES.get("context"),
        "entered": entered,
        "imported": time.time(),
    }
    tracker = elastic.ElasticTracker(
        folder,
        rank,
        world_size,
        launch.launch_id,
        times,
        startup=launch.startup,
        process=this_process(),
    )
    node_metrics = system_metrics(context, cfg, launch)
    drain = elastic.DrainWatcher(
        rank,
        preemption_info=elastic.preemption_notice(),
        requests=elastic.DrainRequests(folder, launch.launch_id) if rank == 0 else None,
    )
    announce_resume(ray.train.get_checkpoint())
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
        on_checkpoint=report_checkpoint,
        should_stop=drain,
        logger=logger,
        device=assigned_device(cfg.cluster.use_gpu),
        before_step=elastic.chain(
            tracker.before_step,
            elastic.FaultInjector(cfg.fault, rank, folder),
            spare_request(cfg),
        ),
        after_step=after_steps(tracker.on_step, node_metrics and node_metrics.on_step),
        may_write=LeaseGuard(folder.location, launch.launch_id),
        snapshot_root=snapshot_root(cfg, launch),
    )
    try:
        with elastic.training():
            result = run_training(cfg, ctx)
    except fatal_errors() as e:
        end_fatally(folder, rank, launch, e)
        if rank == 0:  # the driver waits for this line
            print(end_of_output(launch.launch_id), flush=True)
        return
    finally:
        logger.close()
        if node_metrics is not None:
            node_metrics.finish()
    if rank == 0 and result.steps_done >= cfg.train.steps:  # the driver waits for this line
        if drain.requests is not None:
            drain.requests.finished(result.steps_done)
        print(end_of_output(launch.launch_id), flush=True)
    if result.steps_done < cfg.train.steps:  # the loop only returns early when asked to stop
        tracker.left(result.steps_done)
        if drain.requests is not None:  # its checkpoint is committed: the controller may go on
            drain.requests.acknowledge(result.steps_done)
        agree_who_leaves(drain, rank, world_size)
        if drain.leaving and ctx.snapshot_root:  # this node goes: so does its keeper
            stop_node_keeper(cfg, launch)
        leave_together(rank, world_size)
        elastic.leave(
            drain,
            f"rank {rank} left at step {result.steps_done} of {cfg.train.steps} "
            f"({drain.reason or 'another rank was asked to stop'}) after "
            f"committing {result.last_checkpoint}; Ray Train restarts the worker "
            "group from it",
        )


def agree_who_leaves(drain, rank: int, world_size: int) -> None:
    """Every rank learns whether its own process must go. The group stopped on one rank's word
    (the loop agrees with a MAX all-reduce), but Ray hands its preemption notice to each worker
    in turn: a preempted rank can stop on another's notice before its own arrived, and would
    then neither stop its node's keeper (the node lingers, and keeps copies of snapshots
    meant to be elsewhere) nor end its process. Each rank contributes the ranks it knows must
    go (the notice's, or itself after a SIGTERM); a MAX all-reduce unites them."""
    if world_size <= 1:
        return
    import torch  # noqa: PLC0415 -- torch: loaded in a worker already
    import torch.distributed as dist  # noqa: PLC0415 -- the same

    if not dist.is_initialized():
        return
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    going = torch.zeros(world_size, device=device)
    for r in drain.leaving_ranks():
        going[r] = 1.0
    try:
        dist.all_reduce(going, op=dist.ReduceOp.MAX)
    except Exception as e:  # another rank is gone already: keep what this one knows
        print(f"rank {rank}: cannot learn who leaves ({type(e).__name__}: {e})", flush=True)
        return
    if going[rank].item() > 0 and not drain.leaving:
        drain.leaving = True
        print(f"rank {rank}: another rank saw this one's preemption notice: leaving", flush=True)


def leave_together(rank: int, world_size: int) -> None:
    """Wait until every rank has done its bookkeeping (rank 0's record of where the group left
    and its answer to the controller's drain request, a leaving node's keeper stopped) before
    any rank ends: the first DrainedError Ray sees may be the run's last allowed failure, and
    Ray then kills the whole group at once."""
    if world_size <= 1:
        return
    import torch.distributed as dist  # noqa: PLC0415 -- torch: loaded in a worker already

    try:
        if dist.is_initialized():
            dist.barrier()
    except Exception as e:  # another rank is gone already: nothing to wait for
        print(f"rank {rank}: leaving without the others ({type(e).__name__}: {e})", flush=True)


FATAL = "fatal.json"
"""In the run's elastic/ folder: the error that ended a launch's training for good."""


def fatal_errors() -> tuple[type, ...]:
    """Errors that every rank raises alike and a restart would only repeat: the run diverged, or
    the configuration does not fit the run (a checkpoint of another model, a vocabulary too
    small). Ray Train 2.60 retries every worker failure (its failure policy has no per-error
    rule), so the workers end cleanly and hand the error to the driver instead."""
    from trainer.checkpointing import RunTakenOver  # noqa: PLC0415 -- torch: in the worker only
    from trainer.config import ConfigError  # noqa: PLC0415
    from trainer.loop import DivergenceError  # noqa: PLC0415

    return (DivergenceError, ConfigError, RunTakenOver)


def end_fatally(folder, rank: int, launch: LaunchInfo, error: Exception) -> None:
    """Rank 0 records the error for the driver (durable: the driver reads it after fit)."""
    if rank == 0:
        doc = {"launch_id": launch.launch_id, "type": type(error).__name__, "error": str(error)}
        folder.write(FATAL, doc, durable=True)
    print0(f"error: {type(error).__name__}: {error} (not retried: a restart would repeat it)")


def fatal_error(cluster, launch_id: str) -> Optional[str]:
    """The driver's side: the error this launch's workers ended with, if they recorded one in
    <run folder>/elastic (`cluster`: the job's ClusterConfig)."""
    from cluster.elastic.run_folder import ELASTIC_DIR, RunFolder  # noqa: PLC0415 -- imports ray

    folder = run_folder(cluster.storage_path, cluster.run_name, ELASTIC_DIR)
    record = RunFolder.at(folder).read(FATAL)
    if record and record.get("launch_id") == launch_id:
        return f"{record['type']}: {record['error']}"
    return None


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


def snapshots_on(cfg) -> bool:
    """train.snapshot_every: N > 0 always; null only on GPU workers. On CPU workers the training
    itself uses the CPUs the background copy would need (benchmarks.snapshots here: 1.44-1.47x
    the step time), so null means none there; set N to have them anyway."""
    every = cfg.train.snapshot_every
    return every != 0 and (every is not None or cfg.cluster.use_gpu)


def snapshot_root(cfg, launch: LaunchInfo) -> Optional[str]:
    """Where this launch's in-memory snapshots go: keeper://, the memory of a keeper actor per
    node, each file on its writer's node and the next (cluster/elastic/snapshots.py); this
    node's keeper is started here if no worker started it yet. None when snapshots are off
    (`snapshots_on`)."""
    if not snapshots_on(cfg):
        return None
    import ray  # noqa: PLC0415 -- ray: seconds to import; loaded already in a worker

    from cluster.elastic import snapshots  # noqa: PLC0415 -- imports ray

    snapshots.register_keeper_scheme()
    key = snapshots.run_key_of(cfg.cluster.run_name, launch.launch_id)
    snapshots.ensure_keeper(key, ray.get_runtime_context().get_node_id())
    return f"keeper://{key}/snapshots"


def stop_node_keeper(cfg, launch: LaunchInfo) -> None:
    """A node being drained (preempted, or a SIGTERM) goes idle, and leaves, only once nothing
    runs on it; its keeper would keep it. Its snapshot files all have a copy on another node,
    and the drain committed a durable checkpoint anyway."""
    import ray  # noqa: PLC0415 -- ray: seconds to import; loaded already in a worker

    from cluster.elastic import snapshots  # noqa: PLC0415 -- imports ray

    key = snapshots.run_key_of(cfg.cluster.run_name, launch.launch_id)
    try:
        snapshots.stop_keeper(key, ray.get_runtime_context().get_node_id())
    except Exception as e:  # another rank of this node stopped it first, or Ray is going
        print(f"snapshots: this node's keeper: {type(e).__name__}: {e}", flush=True)


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
