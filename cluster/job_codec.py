"""JobConfig <-> plain dict, the form Ray ships to each worker (train_loop_config).

A dict of builtins pickles the same under any Ray version and shows readably in Ray's dashboard;
the worker rebuilds the dataclasses and never sees Hydra or OmegaConf.
"""
from __future__ import annotations

import dataclasses
import typing

from trainer.config import JobConfig


def job_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def job_from_dict(data: dict) -> JobConfig:
    """Inverse of job_to_dict; an unknown section or key raises TypeError naming it."""
    sections = typing.get_type_hints(JobConfig)
    unknown = set(data) - set(sections)
    if unknown:
        raise TypeError(f"unknown JobConfig sections {sorted(unknown)}; valid: {sorted(sections)}")
    return JobConfig(**{name: sections[name](**data[name]) for name in data})
