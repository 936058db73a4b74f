"""The job `python -m cluster.train <overrides>` composes, for tests of trainer/data that hold
the data commands to what training reads (cluster/ is the reference here, never imported by
trainer/)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from cluster.compose import register_schemas, to_job_config
from cluster.config import JobConfig

CONF = Path(__file__).resolve().parents[2] / "conf"


def hydra_composed(*overrides: str) -> DictConfig:
    """The DictConfig `python -m cluster.train <overrides>` composes."""
    register_schemas()
    with initialize_config_dir(str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def training_job(*overrides: str) -> JobConfig:
    """The typed job of those overrides (cluster/compose.py's to_job_config)."""
    return to_job_config(hydra_composed(*overrides))
