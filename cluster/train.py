"""The entry point: one command from a Hydra config to a trained, checkpointed, tracked model.

    python -m cluster.train                                   # the default job (conf/config.yaml)
    python -m cluster.train train.steps=200 cluster.num_workers=4 sharding=shard_grad_op
    elastic-fsdp-train ...                                    # the same, as a console script

The story, top to bottom: compose and validate the config (every error before any worker
starts), prepare the data once, create the MLflow run, start or join Ray, run the Ray Train V2
TorchTrainer (cluster/worker.py in each worker), and say where the results are.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cluster.config_schema import register_schemas, to_job_config
from cluster.job_codec import job_to_dict
from cluster.paths import with_absolute_paths
from cluster.ray_checkpoint import read_pointer
from cluster.worker import LaunchInfo, worker_config
from trainer.config import ConfigError, JobConfig
from trainer import metrics

register_schemas()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def hydra_main(dictcfg: DictConfig) -> Optional[dict]:
    launch_dir = os.getcwd()  # hydra.job.chdir is false: this is where the user launched
    cfg = checked_config(dictcfg, launch_dir)
    prepare_data(cfg)
    connect_ray(cfg)
    run_id = start_tracking(cfg, dictcfg)
    result = None
    try:
        result = fit(cfg, run_id)
    finally:
        if run_id:
            metrics.end_run(cfg.tracking.tracking_uri, run_id, ok=result is not None)
    return closing_note(cfg, run_id, result)


def main() -> None:
    """Console script `elastic-fsdp-train`; Hydra reads the overrides from sys.argv."""
    hydra_main()


def checked_config(dictcfg: DictConfig, launch_dir: str) -> JobConfig:
    """Typed, validated, with absolute paths, or exit 2 with the message: no worker has started."""
    try:
        cfg = to_job_config(dictcfg).validate()
        from trainer.data import resolve_source

        resolve_source(cfg.data.source)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return with_absolute_paths(cfg, launch_dir)


def prepare_data(cfg: JobConfig) -> None:
    """Tokenise the corpus into Parquet shards once, on the driver; workers only read them."""
    from trainer.data import prepare

    info = prepare(cfg.data)
    state = "prepared now" if info.created else "already prepared"
    print(f"data: {info.num_tokens:,} tokens from {info.num_files} files in {info.uri} ({state})",
          flush=True)


def start_tracking(cfg: JobConfig, dictcfg: DictConfig) -> Optional[str]:
    """The MLflow run every worker logs into, with the resolved config as params and artifact."""
    if not cfg.tracking.enabled:
        return None
    run_id = metrics.create_run(cfg, cfg.tracking.tracking_uri)
    resolved = Path(hydra_output_dir()) / "resolved_config.yaml"
    resolved.write_text(OmegaConf.to_yaml(dictcfg, resolve=True))
    metrics.MLflowLogger(cfg.tracking.tracking_uri, run_id).log_artifact(str(resolved))
    print(f"mlflow: run {run_id} in experiment '{cfg.tracking.experiment}' "
          f"at {cfg.tracking.tracking_uri}", flush=True)
    return run_id


def hydra_output_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir


def connect_ray(cfg: JobConfig) -> None:
    """Start or join Ray before the MLflow run exists, so an unreachable cluster leaves no run."""
    from cluster.ray_launch import connect

    try:
        connect(cfg.cluster)
    except ConnectionError as e:
        print(f"error: cannot reach Ray (cluster.address={cfg.cluster.address!r}, "
              f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}): {e}", file=sys.stderr)
        sys.exit(1)


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
    note = {"last_step": pointer.get("step"), "checkpoint": pointer.get("checkpoint"),
            "checkpoint_root": cfg.train.checkpoint_dir,
            "first_loss": losses[0][1] if losses else None,
            "final_loss": losses[-1][1] if losses else None, "mlflow_run_id": run_id,
            "tracking_uri": cfg.tracking.tracking_uri, "experiment": cfg.tracking.experiment}
    print("\n== done ==")
    if losses:
        print(f"loss:       {_fmt(note['first_loss'])} at step {losses[0][0]} -> "
              f"{_fmt(note['final_loss'])} at step {losses[-1][0]}")
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
