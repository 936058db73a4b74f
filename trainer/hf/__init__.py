"""Hugging Face interchange: config.json <-> ModelConfig, tensor names and the rotary layout
both ways, weights in by byte range, weights out in transformers' safetensors layout.

    cfg = config_from_hf(read_hf_config("s3://bucket/Llama-3.2-1B"))   # ConfigError if unsupported
    weights = HFWeights("s3://bucket/Llama-3.2-1B", cfg)
    load_params(fsdp, weights.read)          # each rank reads only the byte ranges of its shard
    export_hf(checkpoint_path, "out/", dtype=torch.bfloat16)  # config.json, model*.safetensors, ...

    python -m trainer.hf import /models/Llama-3.2-1B/ runs/my-run/checkpoints/   # __main__.py
    python -m trainer.hf export runs/my-run/checkpoints/step_000000060 out/ --dtype bfloat16

    family.py       what a model family provides: config mapping both ways, names, shapes
    llama.py        the Llama family and the Llama-shaped decoder all families share
    qwen2.py        Qwen2/2.5: q/k/v biases
    qwen3.py        Qwen3: per-head q/k norms, decoupled head_dim
    qwen2_vl.py     Qwen2-VL: the Qwen2 decoder with 3-D rotary positions and an image tower
    mistral.py      Mistral: Llama-shaped (a sliding window is refused)
    config.py       the registry of families by model_type; config.json <-> ModelConfig
    names.py        Hugging Face tensor names <-> ours; the rotary row permutation
    safetensors.py  weights in: ranged safetensors reads, HFWeights (our parameters)
    writer.py       weights out: the streaming SafetensorsWriter, export_hf
    importer.py     the import command: import_hf and its step-0 trainer state
    __main__.py     the commands: import (import_hf) and export (export_hf)

A new family is one module defining a `Family`, added to `config.FAMILIES`.
"""

from trainer.hf.config import (
    CONFIG,
    FAMILIES,
    GENERATION_CONFIG,
    config_from_hf,
    config_to_hf,
    expected_tensors,
    family_of,
    ordered_params,
    read_hf_config,
    resolve_model,
    special_ids,
)
from trainer.hf.family import Family
from trainer.hf.importer import IMPORT_RANK_BYTES, import_hf
from trainer.hf.names import NameMap, is_rotary, rotary_rows
from trainer.hf.safetensors import HFWeights, Safetensors
from trainer.hf.writer import SafetensorsWriter, export_hf

__all__ = [
    "CONFIG",
    "FAMILIES",
    "GENERATION_CONFIG",
    "IMPORT_RANK_BYTES",
    "Family",
    "HFWeights",
    "NameMap",
    "Safetensors",
    "SafetensorsWriter",
    "config_from_hf",
    "config_to_hf",
    "expected_tensors",
    "export_hf",
    "family_of",
    "import_hf",
    "is_rotary",
    "ordered_params",
    "read_hf_config",
    "resolve_model",
    "rotary_rows",
    "special_ids",
]
