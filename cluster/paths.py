"""Where a run's files live, fixed on the driver before any worker starts.

Ray workers run in their own working directory (on other machines, on a cluster), so every
relative path in the config is made absolute against the launch directory first.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from trainer.config import JobConfig
from trainer.metrics import resolve_tracking_uri


def is_uri(path: str) -> bool:
    """True for pyarrow.fs URIs (s3://, gs://, file://...), which are left as they are."""
    return "://" in path


def absolute(path: str, base_dir: str) -> str:
    if is_uri(path) or Path(path).is_absolute():
        return path
    return str((Path(base_dir) / path).resolve())


def checkpoint_root(storage_path: str, run_name: str) -> str:
    """The run's checkpoints: inside Ray's run folder, so one run name means one checkpoint
    history, and a resubmitted run finds its checkpoints again."""
    return f"{storage_path.rstrip('/')}/{run_name}/checkpoints"


def with_absolute_paths(cfg: JobConfig, base_dir: str) -> JobConfig:
    """A copy of cfg with data, storage, checkpoint and tracking locations absolute.

    train.checkpoint_dir is set to the run's checkpoint root under cluster.storage_path, so the
    recorded config (MLflow params) says where the checkpoints really are.
    """
    storage_path = absolute(cfg.cluster.storage_path, base_dir)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, prepared_dir=absolute(cfg.data.prepared_dir, base_dir)),
        cluster=dataclasses.replace(cfg.cluster, storage_path=storage_path),
        train=dataclasses.replace(
            cfg.train, checkpoint_dir=checkpoint_root(storage_path, cfg.cluster.run_name)),
        tracking=dataclasses.replace(
            cfg.tracking, tracking_uri=resolve_tracking_uri(cfg.tracking.tracking_uri, base_dir)),
    )
