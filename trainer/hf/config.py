"""config.json <-> our ModelConfig, by family: the registry of families and the lookups on it.

    cfg = config_from_hf(read_hf_config("s3://bucket/Llama-3.2-1B"))   # ConfigError if unsupported
    config_to_hf(cfg, torch.bfloat16, eos_id=2)       # the config.json of an export

A family (trainer/hf/family.py) is found by config.json's model_type on the way in and by our
ModelConfig on the way out (`family_of`); other model_types are refused naming those supported.
"""

from __future__ import annotations

import json
from typing import Optional

import torch

from trainer import storage
from trainer.config import ConfigError, ModelConfig
from trainer.hf.family import Family, refuse
from trainer.hf.llama import LLAMA

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA,)}
"""The supported families by config.json's model_type."""


def family_of(cfg: ModelConfig) -> Family:
    """The family of our model. ModelConfig names none yet: every model of ours is a Llama (the
    second family adds that field, and this is the one place that reads it)."""
    return LLAMA


def hf_family(hf: dict, where: str) -> Family:
    """The family of a Hugging Face config.json; a ConfigError naming the supported ones."""
    family = FAMILIES.get(hf.get("model_type"))
    if family is None:
        supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())
        refuse(hf, where, "model_type", supported)
    archs = hf.get("architectures") or [family.architecture]
    if archs != [family.architecture]:
        refuse(hf, where, "architectures", str([family.architecture]))
    return family


def read_hf_config(path: str) -> dict:
    loc = storage.resolve(path).child(CONFIG)
    try:
        return json.loads(storage.read_bytes(loc))
    except FileNotFoundError:
        raise ConfigError(
            f"invalid config: model.hf_path={path!r} has no {CONFIG}; valid: the "
            "folder or URI of a Hugging Face Llama checkpoint"
        ) from None
    except ValueError as e:
        raise ConfigError(f"invalid config: {loc} is not JSON ({e})") from None


def config_from_hf(
    hf: dict, where: str = "config.json", hf_path: Optional[str] = None
) -> ModelConfig:
    """Our ModelConfig of a Hugging Face config; anything our model cannot represent is a
    ConfigError naming the field and its value, never approximated."""
    fields = hf_family(hf, where).from_hf(hf, where)
    cfg = ModelConfig(name="hf", **fields, hf_path=hf_path)
    cfg.validate()
    return cfg


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    """cfg itself, or, with model.hf_path, the shape of that checkpoint's config.json."""
    if not cfg.hf_path:
        return cfg
    return config_from_hf(read_hf_config(cfg.hf_path), f"{cfg.hf_path}/{CONFIG}", cfg.hf_path)


def config_to_hf(
    cfg: ModelConfig, dtype: torch.dtype, eos_id: Optional[int] = None, bos_id: Optional[int] = None
) -> dict:
    """The config.json of our model in its family's transformers format."""
    return family_of(cfg).to_hf(cfg, dtype, eos_id, bos_id)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our model's parameters and shapes, without building it."""
    return family_of(cfg).shapes(cfg)


def ordered_params(cfg: ModelConfig) -> list[str]:
    """Our parameters in transformers' order (embedding, blocks, norm, head)."""
    names = list(expected_tensors(cfg))
    first = ["tok_embeddings.weight"]
    last = ["norm.weight"] + ([] if cfg.tie_embeddings else ["output.weight"])
    return first + [n for n in names if n not in first + last] + last
