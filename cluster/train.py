"""The entry point: one command from a Hydra config to a trained, checkpointed, tracked model.

    python -m cluster.train                                   # the default job (conf/config.yaml)
    python -m cluster.train train.steps=200 cluster.num_workers=4 sharding=shard_grad_op
    python -m cluster.train -m sharding=full_shard,shard_grad_op,no_shard,hybrid_shard  # a sweep
    elastic-fsdp-train ...                                    # the same, as a console script

The story of one job, top to bottom: compose and validate the config (every error before any
worker starts), prepare the data once, start or join Ray, create the MLflow run (with the resolved
config and the memory plan), run the Ray Train V2 TorchTrainer (cluster/worker.py in each
worker), log the loss curve, and say where the results are. In a sweep (-m) each job is one such
story; cluster/sweep.py checks all of them before the first, starts Ray once, and makes each
job's run a child of the sweep's parent run.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cluster.config_schema import register_schemas
from cluster.job_codec import job_to_dict
from cluster.ray_checkpoint import read_pointer
from cluster.sweep import JobSlot, connect_largest, current_slot, job_config
from cluster.worker import LaunchInfo, worker_config
from trainer.config import ConfigError, JobConfig
from trainer import metrics

register_schemas()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def hydra_main(dictcfg: DictConfig) -> Optional[dict]:
    launch_dir = os.getcwd()  # hydra.job.chdir is false: this is where the user launched
    slot = current_slot()  # this job's place in a sweep; None for a plain run
    cfg = checked_config(dictcfg, launch_dir, slot)
    prepare_data(cfg)
    connect_ray(cfg)
    run_id = start_tracking(cfg, slot)
    result = None
    try:
        result = fit(cfg, run_id)
    finally:
        if run_id:
            finish_tracking(cfg, run_id, slot, ok=result is not None)
    return closing_note(cfg, run_id, result)


def main() -> None:
    """Console script `elastic-fsdp-train`; Hydra reads the overrides from sys.argv."""
    hydra_main()


def checked_config(dictcfg: DictConfig, launch_dir: str, slot: Optional[JobSlot]) -> JobConfig:
    """Typed, validated, with absolute paths, or exit 2 with the message: no worker has started.
    (A sweep's jobs were all checked the same way before the first one started.)"""
    try:
        return job_config(dictcfg, launch_dir, slot)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def prepare_data(cfg: JobConfig) -> None:
    """Tokenise the corpus into Parquet shards once, on the driver; workers only read them."""
    from trainer.data import prepare

    info = prepare(cfg.data)
    state = "prepared now" if info.created else "already prepared"
    print(f"data: {info.num_tokens:,} tokens from {info.num_files} files in {info.uri} ({state})",
          flush=True)


def start_tracking(cfg: JobConfig, slot: Optional[JobSlot]) -> Optional[str]:
    """The MLflow run every worker logs into: params are the resolved config, which is also an
    artifact, with the memory plan. In a sweep it is a child of the parent run, named after the
    job's swept values."""
    if not cfg.tracking.enabled:
        return None
    uri = cfg.tracking.tracking_uri
    if slot is None:
        run_id = metrics.create_run(cfg, uri)
    else:
        run_id = metrics.create_run(cfg, uri, parent_run_id=slot.parent_run_id,
                                    run_name=slot.label or f"job {slot.num}",
                                    tags={"sweep.job": slot.num, "sweep.dir": slot.sweep_dir})
    logger = metrics.MLflowLogger(uri, run_id)
    out = Path(hydra_output_dir())
    logger.log_artifact(write_resolved_config(cfg, out / "resolved_config.yaml"))
    plan = write_memory_plan(cfg, out / "memory_plan.txt")
    if plan:
        logger.log_artifact(plan)
    print(f"mlflow: run {run_id} in experiment '{cfg.tracking.experiment}' at {uri}"
          + (f" (child of sweep run {slot.parent_run_id})" if slot and slot.parent_run_id else ""),
          flush=True)
    return run_id


def write_resolved_config(cfg: JobConfig, path: Path) -> str:
    """The config exactly as the workers run it (absolute paths, the job's run name): the same
    values as the run's params, as YAML."""
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg))))
    return str(path)


def write_memory_plan(cfg: JobConfig, path: Path) -> Optional[str]:
    """trainer.plan's per-worker memory table, for the smallest world size (the most memory per
    worker) and the largest, against the memory the workers' devices have as far as this driver
    can tell; None (said on the console) where it cannot tell or the planner is absent."""
    try:
        from trainer.plan import plan
    except ImportError as e:
        print(f"memory plan: not logged (trainer.plan unavailable: {e})", flush=True)
        return None
    memory, source = device_memory(cfg)
    if memory is None:
        print(f"memory plan: not logged ({source})", flush=True)
        return None
    sizes = sorted(set(cfg.cluster.world_sizes))
    # A local Ray puts every worker on this one node; on a cluster the planner's default applies.
    per_node = {"local_world_size": sizes[-1]} if is_local_ray(cfg) else {}
    try:
        tables = [plan(cfg, n, memory, **per_node).table() for n in sizes]
    except Exception as e:  # the plan is a prediction: it must never stop the training it describes
        print(f"memory plan: not logged ({type(e).__name__}: {e})", flush=True)
        return None
    path.write_text(f"device memory: {memory / 2**30:.1f} GiB ({source})\n\n"
                    + "\n\n".join(tables) + "\n")
    return str(path)


def device_memory(cfg: JobConfig) -> tuple[Optional[int], str]:
    """(bytes one worker's device has, where that figure comes from) or (None, why not)."""
    if cfg.cluster.use_gpu:
        import torch

        if not torch.cuda.is_available():
            return None, "GPU workers, and this driver sees no GPU to read their memory from"
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"this driver's {props.name}, taken as the workers' GPU"
    import psutil

    return psutil.virtual_memory().total, "CPU workers: this host's memory"


def is_local_ray(cfg: JobConfig) -> bool:
    from cluster.ray_launch import ray_address

    return ray_address(cfg.cluster) is None


def finish_tracking(cfg: JobConfig, run_id: str, slot: Optional[JobSlot], ok: bool) -> None:
    """Log the loss curve (also of a failed run: it shows where it failed), then end the run."""
    uri = cfg.tracking.tracking_uri
    try:
        losses = metrics.metric_history(uri, run_id, "train/loss")
        if losses:
            from cluster.report import plot_loss_curves

            lo, hi = cfg.cluster.world_sizes
            world = str(hi) if lo == hi else f"{lo}-{hi}"
            label = (slot.label if slot else "") or cfg.cluster.run_name
            path = Path(hydra_output_dir()) / "loss_curve.png"
            plot_loss_curves({label: losses}, str(path),
                             f"train/loss: {cfg.sharding.strategy} on {world} workers")
            metrics.MLflowLogger(uri, run_id).log_artifact(str(path))
    except Exception as e:  # never hide the training's own outcome behind a plotting error
        print(f"mlflow: loss curve not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    finally:
        metrics.end_run(uri, run_id, ok=ok)


def hydra_output_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir


def connect_ray(cfg: JobConfig) -> None:
    """Start or join Ray before the MLflow run exists, so an unreachable cluster leaves no run."""
    connect_largest([cfg])


def fit(cfg: JobConfig, run_id: Optional[str]):
    """Run the TorchTrainer to completion; Ray retries failures up to cluster.max_failures."""
    from cluster.ray_launch import build_trainer

    launch = LaunchInfo(checkpoint_root=cfg.train.checkpoint_dir, mlflow_run_id=run_id)
    trainer = build_trainer(cfg, worker_config(job_to_dict(cfg), launch))
    return trainer.fit()


def closing_note(cfg: JobConfig, run_id: Optional[str], result) -> dict:
    """Print where everything is and return it (Hydra keeps a multirun's return values)."""
    pointer = read_pointer(result.checkpoint) or {}
    losses = metrics.metric_history(cfg.tracking.tracking_uri, run_id, "train/loss") if run_id else []
    restarts = metrics.metric_history(cfg.tracking.tracking_uri, run_id, "elastic/restarts") if run_id else []
    lost = metrics.metric_history(cfg.tracking.tracking_uri, run_id, "elastic/steps_lost") if run_id else []
    note = {"last_step": pointer.get("step"), "checkpoint": pointer.get("checkpoint"),
            "checkpoint_root": cfg.train.checkpoint_dir,
            "first_loss": losses[0][1] if losses else None,
            "final_loss": losses[-1][1] if losses else None, "mlflow_run_id": run_id,
            "tracking_uri": cfg.tracking.tracking_uri, "experiment": cfg.tracking.experiment,
            "restarts": int(restarts[-1][1]) if restarts else 0, "steps_lost": int(sum(v for _, v in lost))}
    print("\n== done ==")
    if losses:
        print(f"loss:       {_fmt(note['first_loss'])} at step {losses[0][0]} -> "
              f"{_fmt(note['final_loss'])} at step {losses[-1][0]}")
    if note["restarts"]:
        print(f"elastic:    {note['restarts']} worker-group restarts, {note['steps_lost']} steps trained again")
    print(f"checkpoint: {note['checkpoint'] or 'none reported'} (this run's checkpoints are "
          f"under {cfg.train.checkpoint_dir})")
    if run_id:
        print(f"mlflow run: {run_id} in experiment '{cfg.tracking.experiment}', "
              f"tracking URI {cfg.tracking.tracking_uri}")
        print(f"see it:     {metrics.ui_command(cfg.tracking.tracking_uri)}")
    sys.stdout.flush()
    return note


def _fmt(loss) -> str:
    return "?" if loss is None else f"{loss:.4f}"


if __name__ == "__main__":
    main()
