"""The model to generate from: one of our checkpoint steps or a Hugging Face folder, built on
the device and filled tensor by tensor (never consolidated on disk, never a second copy of the
model in host memory).

    source = open_source("runs/x/checkpoints/step_000001000")   # or an HF folder, or a URI
    model = source.load("cuda", torch.bfloat16)
    source.text                                                 # tokenizer, template, stop ids

A folder holding step_* checkpoints (a run's checkpoints/) means its newest committed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from trainer import storage
from trainer.checkpoint import CheckpointReader, latest_checkpoint
from trainer.checkpoint.catalog import step_dirs
from trainer.checkpoint.format import MANIFEST, CheckpointError, parse_step_dir
from trainer.checkpoint.keys import param_key
from trainer.config import ConfigError, ModelConfig
from trainer.generate.text import Text, text_of_checkpoint, text_of_hf_dir
from trainer.hf import CONFIG, HFWeights, config_from_hf, read_hf_config
from trainer.model import Transformer, build_model

Read = Callable[[str], torch.Tensor]
"""read(fqn) -> the whole parameter (any shape with its numel; fp32 on the host)."""


@dataclass
class Source:
    path: str
    kind: str
    """'checkpoint' or 'hf'."""
    cfg: ModelConfig
    text: Text
    read: Read
    close: Callable[[], None]
    """Closes the files the reads opened."""

    def load(self, device, dtype: torch.dtype) -> Transformer:
        """The model on `device` in `dtype`, in eval mode; the source's files closed after."""
        try:
            return build_filled(self.cfg, self.read, device, dtype)
        finally:
            self.close()


def open_source(path: str, log: Callable[[str], None] = print) -> Source:
    """The checkpoint step, checkpoints folder or Hugging Face folder at `path`; a ConfigError
    saying what was looked for when it is none of them (CheckpointError for a torn one)."""
    loc = storage.resolve(path)
    if parse_step_dir(loc.name) is not None or storage.exists(loc.child(MANIFEST)):
        return checkpoint_source(path)
    if storage.exists(loc.child(CONFIG)):
        return hf_source(path)
    if step_dirs(path):
        latest = latest_checkpoint(path, log)
        if latest is None:
            raise CheckpointError(f"{path}: none of its step_* checkpoints is committed and whole")
        log(f"generate: the newest checkpoint under {path} is {latest}")
        return checkpoint_source(latest)
    raise ConfigError(
        f"invalid config: PATH={path!r} is neither a checkpoint (no {MANIFEST}) nor a Hugging "
        f"Face folder (no {CONFIG}); valid: a checkpoint step (runs/<run>/checkpoints/"
        "step_NNNNNNNNN), a folder of them, or a folder with config.json and *.safetensors"
    )


def checkpoint_source(path: str) -> Source:
    """Reads each parameter's whole tensor from the step's shards (`model/<fqn>` keys)."""
    reader = CheckpointReader(path)
    raw = reader.state.get("model_config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: no model_config in its state: cannot build the model")
    cfg = ModelConfig(**raw)
    cfg.validate()

    def read(fqn: str) -> torch.Tensor:
        return reader.read_full(param_key(fqn))

    text = text_of_checkpoint(reader.state, path)
    return Source(path, "checkpoint", cfg, text, read, reader.close)


def hf_source(path: str) -> Source:
    """Reads each parameter through HFWeights (our names and rotary layout)."""
    cfg = config_from_hf(read_hf_config(path), f"{path}/{CONFIG}", hf_path=path)
    weights = HFWeights(path, cfg)
    shapes = weights.expected

    def read(fqn: str) -> torch.Tensor:
        return weights.read(fqn, 0, math.prod(shapes[fqn]))

    return Source(path, "hf", cfg, text_of_hf_dir(path), read, lambda: None)


def build_filled(cfg: ModelConfig, read: Read, device, dtype: torch.dtype) -> Transformer:
    """Built on meta, cast there (nothing allocated), materialised on `device` in `dtype`, then
    each parameter copied in from `read` (one host tensor at a time)."""
    model = build_model(cfg, device="meta").to(dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            p.copy_(read(fqn).view(p.shape))
    return model.eval()
