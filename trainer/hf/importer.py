"""The import command: a Hugging Face checkpoint as a step-0 sharded checkpoint of ours.

    python -m trainer.hf import /models/Llama-3.1-8B/ runs/llama-ft/checkpoints/

The checkpoint is written as files of about IMPORT_RANK_BYTES each (one "rank" each), so the
importer holds one such file's tensors at a time, never the model; any world size, strategy or
wrap policy resumes from it. Its trainer state keeps the source's bos/eos ids
(`HF_SPECIAL_IDS`), which an export falls back on when the run's tokenizer names none.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from trainer.checkpoint import CheckpointWriter, TensorChunk
from trainer.checkpoint.keys import param_key
from trainer.checkpoint.trainer_state import TrainerState, model_digest
from trainer.config import ModelConfig
from trainer.hf.config import CONFIG, config_from_hf, ordered_params, read_hf_config, special_ids
from trainer.hf.safetensors import HFWeights

IMPORT_RANK_BYTES = 2**30
"""import_hf writes its step-0 checkpoint as files of about this size (one "rank" each), so the
importer holds one such file's tensors at a time, never the model."""

HF_SPECIAL_IDS = "hf_special_ids"
"""The trainer state's key for the source's {"bos_token_id", "eos_token_id"} (config.json,
generation_config.json): TrainerState.hf_special_ids, read by the export."""


def imported_state(src: str, cfg: ModelConfig, world: int, ids: dict) -> dict:
    """The trainer state of the step-0 checkpoint imported from `src`: no data position, no
    optimizer steps, no batch size yet (any run may resume from it); `ids`: the source's
    special token ids."""
    state = TrainerState(
        step=0,
        consumed_samples=0,
        global_batch_size=None,
        optim_step=0.0,
        lr=0.0,
        world_size=world,
        strategy="imported",
        model_config=dataclasses.asdict(cfg),
        model_digest=model_digest(cfg),
        grad_scaler={},
        rng_cpu=None,
        data={},
        imported_from=src,
        hf_special_ids=ids,
    ).to_json()
    return state


def _rank_groups(weights: HFWeights, cfg: ModelConfig) -> list[list[str]]:
    """Our parameters in transformers' order, cut into files of about IMPORT_RANK_BYTES."""
    groups, current, size = [], [], 0
    for fqn in ordered_params(cfg):
        nbytes = math.prod(weights.expected[fqn]) * 4
        if current and size + nbytes > IMPORT_RANK_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(fqn)
        size += nbytes
    groups.append(current)
    return groups


def import_hf(src: str, dest_root: str, log=print) -> str:
    """A step-0 sharded checkpoint of the Hugging Face checkpoint at `src`, under `dest_root`
    (a run's checkpoints folder): fp32 weights, no optimizer state. Any world size, strategy or
    wrap policy resumes from it. Returns its path."""

    hf = read_hf_config(src)
    cfg = config_from_hf(hf, f"{src}/{CONFIG}", hf_path=src)
    weights = HFWeights(src, cfg)
    groups = _rank_groups(weights, cfg)
    world = len(groups)
    state = imported_state(src, cfg, world, special_ids(src, hf))
    for rank in list(range(1, world)) + [0]:  # rank 0 commits: after every other file is there
        chunks = []
        for fqn in groups[rank]:
            shape = weights.expected[fqn]
            t = weights.read(fqn, 0, math.prod(shape))
            chunks.append(TensorChunk(param_key(fqn), shape, torch.float32, 0, t))
        with CheckpointWriter(dest_root, keep=1_000_000, async_save=False) as writer:
            writer.save(0, rank, world, chunks, state, barrier=lambda: None)
            path = writer.wait()
        log(
            f"import: wrote {len(chunks)} tensors ({sum(c.numel for c in chunks) * 4 / 2**20:,.1f} "
            f"MiB) as file {rank + 1 if rank else world} of {world}"
        )
    return path
