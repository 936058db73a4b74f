"""The data a run reads, once the whole job is known: what data.* leaves to the rest of the job.

    cfg = with_run_defaults(cfg)      # cluster/compose.py's to_job_config, before validate()

- data.eval_fraction null (data=chat's) becomes 0.01 when the run evaluates (train.eval_every >
  0) and 0 when it does not, so a run that never evaluates holds nothing out
  (DataConfig.for_run). The preparation's digest holds the number: the two are two
  preparations, each immutable (DESIGN.md invariant 2).
- model=hf with data.tokenizer unset or 'byte': model.hf_path's own tokenizer.json when the
  folder has one, said in one line (a published model's vocabulary is its tokenizer's, never
  bytes); unset with none there is a ConfigError naming data.tokenizer=<hf_path>/tokenizer.json.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, TypeVar

from trainer import storage
from trainer.config import ConfigError, TrainerConfig

from .tokenizer import BYTE

MODEL_TOKENIZER = "tokenizer.json"
"""The tokenizer file of a Hugging Face model folder (transformers' fast tokenizer)."""

Config = TypeVar("Config", bound=TrainerConfig)


def with_run_defaults(cfg: Config, log=print) -> Config:
    """cfg (a TrainerConfig or the Ray layer's JobConfig) with its data as the run reads it."""
    data = cfg.data.for_run(evaluating=cfg.train.eval_every > 0)
    tokenizer = model_tokenizer(cfg)
    if tokenizer is not None:
        data = dataclasses.replace(data, tokenizer=tokenizer)
        log(
            f"data: data.tokenizer={tokenizer} (model.hf_path's own tokenizer; "
            "data.tokenizer=<a tokenizer.json> takes another)"
        )
    return dataclasses.replace(cfg, data=data)


def model_tokenizer(cfg: TrainerConfig) -> Optional[str]:
    """model.hf_path's tokenizer.json when data.tokenizer is unset or 'byte' and the folder has
    one; None to keep data.tokenizer. Unset, and none in the folder: a ConfigError saying where
    the model's tokenizer would be taken from."""
    hf_path, given = cfg.model.hf_path, cfg.data.tokenizer
    if not hf_path or given not in ("", BYTE):
        return None
    loc = storage.resolve(hf_path).child(MODEL_TOKENIZER)
    if _exists(loc):
        return str(loc)
    if given == BYTE:
        return None  # byte-level data on a model with no tokenizer of its own, as asked
    raise ConfigError(
        f"invalid config: data.tokenizer='' and model.hf_path={hf_path!r} has no "
        f"{MODEL_TOKENIZER}; valid: data.tokenizer={loc} (the model's tokenizer.json, put "
        "there) or data.tokenizer=<the path or URI of the tokenizer the model was trained with>"
    )


def _exists(loc: storage.Location) -> bool:
    try:
        return storage.exists(loc)
    except (OSError, ValueError):  # unreadable storage: the model's own checks say why
        return False
