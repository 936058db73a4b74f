"""Whether a run can continue from a checkpoint: the same model shape, global batch and data
order, or it would load wrongly or repeat and skip samples. The driver asks before any worker
starts (preflight_resume), every worker again before it loads (Checkpointer.resume).

    path = preflight_resume(root, cfg, data_identity(cfg, digest))   # ConfigError, or a path
    check_resumable(reader.state, cfg, data, path)                   # ConfigError
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from trainer.checkpoint import CheckpointError, CheckpointReader, list_checkpoints
from trainer.checkpoint.trainer_state import TrainerState, model_digest
from trainer.config import ConfigError, ModelConfig, TrainerConfig


def data_identity(cfg: TrainerConfig, digest: str) -> dict:
    """TrainerState.data: what the sample order depends on besides the step; a run resumes
    only on the same."""
    return {
        "digest": digest,
        "seq_len": cfg.data.seq_len,
        "seed": cfg.data.seed,
        "weights": [s.weight for s in cfg.data.sources()],
    }


def has_checkpoint(root: str) -> bool:
    """A committed checkpoint exists under `root`: a resume will load one (or fail loudly)."""
    return any(info.problem is None for info in list_checkpoints(root))


def preflight_resume(root: str, cfg: TrainerConfig, data: dict) -> Optional[str]:
    """Before any worker starts: ConfigError if the newest committed checkpoint under `root`
    cannot continue this config (check_resumable); its path, or None when there is none."""
    for info in list_checkpoints(root):
        if info.problem:
            continue
        try:
            state = CheckpointReader(info.path).state
        except CheckpointError:
            continue  # the workers fall back past it, as they do at resume
        check_resumable(state, cfg, data, info.path)
        return info.path
    return None


def check_model(state: dict, model: ModelConfig, path: str) -> None:
    """ConfigError naming the fields that differ when the checkpoint at `path` (its `state`) is
    of another model shape, and for a Hugging Face import (import-hf) the overrides that train
    it (`model=hf model.hf_path=<its source>`)."""
    saved = state.get("model_config") or {}
    if state.get("model_digest") == model_digest(model):
        return
    now = dataclasses.asdict(model)
    keys = [k for k in now if k not in ("name", "hf_path") and saved.get(k) != now[k]]
    changed = ", ".join(f"model.{k}: {saved.get(k)!r} there, {now[k]!r} here" for k in keys)
    source = state.get("imported_from")
    fix = (
        f"model=hf model.hf_path={source} (it was imported from there)"
        if source
        else f"the model it was trained with (model={saved.get('name')} and these fields)"
    )
    raise ConfigError(
        f"invalid config: the checkpoint at {path} is of another model "
        f"({changed or 'the same fields, another digest'}); valid: {fix}, or a new "
        "cluster.run_name to start another run"
    )


def check_resumable(state: dict, cfg: TrainerConfig, data: dict, path: str) -> None:
    """ConfigError, saying what differs and what to do, when the checkpoint at `path` (its
    `state`) cannot continue this config: another model shape, global batch or data order.
    The driver calls it before any worker starts; every worker again before loading."""
    check_model(state, cfg.model, path)
    s = TrainerState.from_json(state)
    if s.imported_from:  # a step-0 import: no data position, any batch, any data
        return
    if s.global_batch_size != cfg.train.global_batch_size:
        raise ConfigError(
            f"invalid config: train.global_batch_size={cfg.train.global_batch_size} "
            f"but the checkpoint at {path} was trained with {s.global_batch_size}; "
            "valid: the same global batch (the data position depends on it)"
        )
    saved = s.data or {}
    changed = sorted(k for k in set(saved) | set(data) if saved.get(k) != data.get(k))
    if data and changed:
        what = ", ".join(f"{k}: {saved.get(k)!r} then, {data.get(k)!r} now" for k in changed)
        raise ConfigError(
            f"invalid config: the checkpoint at {path} was trained on other data ({what}); "
            "resuming would repeat and skip samples. valid: the same data.* settings and "
            "unchanged source files (a prepared dataset is named by the digest of its files, "
            "tokenizer and settings), or a new cluster.run_name"
        )
