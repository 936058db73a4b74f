"""Export: a sharded checkpoint -> consolidated weights for inference, no training code needed.

    python -m trainer.checkpoint export runs/checkpoints/step_000000060 exported/
    # exported/model.safetensors + exported/config.json; load with
    #   cfg = ModelConfig(**json.load(open("exported/config.json")))
    #   model = build_model(cfg, "cpu"); model.load_state_dict(safetensors.torch.load_file(...))

Only "model/*" tensors are exported (optimizer state stays behind), under their parameter names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import pyarrow.fs as pafs
import torch
from safetensors.torch import load_file, save_file

from trainer.checkpoint.format import CheckpointError, dtype_from_name
from trainer.checkpoint.keys import MODEL, param_name
from trainer.checkpoint.reader import CheckpointReader
from trainer.config import ModelConfig

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def export(
    path: str,
    out_dir: str,
    dtype: Optional[str] = None,
    filesystem: Optional[pafs.FileSystem] = None,
) -> dict:
    """Write `out_dir`/model.safetensors and config.json; return a summary (tensors, parameters)."""
    with CheckpointReader(path, filesystem) as reader:
        config = _model_config(reader)
        cast = dtype_from_name(dtype, "--dtype") if dtype else None
        tensors = {}
        for key in reader.keys():
            name = param_name(key)
            if name is not None:
                t = reader.read_full(key)
                tensors[name] = t.to(cast) if cast is not None else t
        if not tensors:
            raise CheckpointError(
                f"{path}: no '{MODEL}*' tensors to export (keys: {reader.keys()[:5]}...)"
            )
        os.makedirs(out_dir, exist_ok=True)
        save_file(
            tensors,
            os.path.join(out_dir, WEIGHTS),
            metadata={"step": str(reader.step), "source": str(reader.location)},
        )
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
    return dict(
        tensors=len(tensors),
        parameters=sum(t.numel() for t in tensors.values()),
        step=reader.step,
        out=out_dir,
    )


def _model_config(reader: CheckpointReader) -> dict:
    """state['model_config'], checked to be a valid ModelConfig so the export is loadable."""
    raw = reader.state.get("model_config")
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{reader.location}: state has no 'model_config' dict (state keys: "
            f"{sorted(reader.state)}); cannot write a loadable config.json"
        )
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise CheckpointError(
            f"{reader.location}: model_config has unknown fields {unknown}; valid: {sorted(fields)}"
        )
    ModelConfig(**raw).validate()
    return raw


def load_exported(out_dir: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict) of an export; the caller builds the model (trainer.model)."""
    with open(os.path.join(out_dir, CONFIG)) as f:
        cfg = ModelConfig(**json.load(f))
    return cfg, load_file(os.path.join(out_dir, WEIGHTS))
