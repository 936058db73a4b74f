"""Hydra's view of trainer.config: the JobConfig dataclass registered as the schema of conf/.

conf/config.yaml lists `job_schema` first in its defaults, so every YAML group file and every
command-line override is merged into a typed, struct-mode JobConfig: an unknown key or a value of
the wrong type fails in Hydra, before any code of ours runs, naming the key and the dataclass.
"""
from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from trainer.config import ConfigError, JobConfig

SCHEMA_NAME = "job_schema"


def register_schemas() -> None:
    """Store JobConfig in Hydra's ConfigStore (idempotent: Hydra replaces an entry of that name)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=JobConfig)


def to_job_config(dictcfg: DictConfig) -> JobConfig:
    """The composed DictConfig as plain dataclasses; Hydra stops here and nothing below sees it.

    Hydra's `+key=value` adds a key even to a typed node, and OmegaConf.to_object then drops it
    without a word; such a key is refused here instead, listing the valid ones.
    """
    check_known_keys(dictcfg, JobConfig)
    job = OmegaConf.to_object(dictcfg)
    if not isinstance(job, JobConfig):
        raise TypeError(f"composed config is {type(job).__name__}, not JobConfig: "
                        f"conf/config.yaml must list '{SCHEMA_NAME}' first in its defaults")
    return job


def check_known_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Raise ConfigError for the first key of `node` that is not a field of dataclass `schema`."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            section = prefix.rstrip(".") or "the top level"
            raise ConfigError(f"invalid config: unknown key {prefix}{key}; valid keys of "
                              f"{section}: {', '.join(fields)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            check_known_keys(child, OmegaConf.get_type(child), f"{prefix}{key}.")
