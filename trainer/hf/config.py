"""config.json <-> our ModelConfig, by family: the registry of families and the lookups on it.

    cfg = config_from_hf(read_hf_config("s3://bucket/Llama-3.2-1B"))   # ConfigError if unsupported
    config_to_hf(cfg, torch.bfloat16, eos_id=[128009, 128001], bos_id=128000)  # an export's
    special_ids("s3://bucket/Llama-3.2-1B")   # {"bos_token_id": 128000, "eos_token_id": ...}

A family (trainer/hf/family.py) is found by config.json's model_type on the way in and by our
ModelConfig's `family` on the way out (`family_of`); other model_types are refused naming those
supported.
"""

from __future__ import annotations

import json
from typing import Optional, Union

import torch

from trainer import storage
from trainer.config import ConfigError, ModelConfig
from trainer.hf.family import Family, refuse
from trainer.hf.llama import LLAMA
from trainer.hf.mistral import MISTRAL
from trainer.hf.mixtral import MIXTRAL
from trainer.hf.qwen2 import QWEN2
from trainer.hf.qwen2_vl import QWEN2_VL
from trainer.hf.qwen3 import QWEN3
from trainer.hf.qwen3_moe import QWEN3_MOE

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, QWEN3_MOE, MIXTRAL, QWEN2_VL)
}
"""The supported families by config.json's model_type (= our ModelConfig.family)."""


def family_of(cfg: ModelConfig) -> Family:
    """The family of our model, by its ModelConfig.family (validated against these names)."""
    family = FAMILIES.get(cfg.family)
    if family is None:
        supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())
        raise ConfigError(
            f"invalid config: model.family={cfg.family!r}; valid: {supported} (trainer/hf "
            "has no Hugging Face format for it)"
        )
    return family


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
    """The config.json of the checkpoint at `path`; a ConfigError naming model.hf_path when the
    folder does not exist (a typo in the path) or holds no config.json (another kind of folder)."""
    folder = storage.resolve(path)
    loc = folder.child(CONFIG)
    try:
        return json.loads(storage.read_bytes(loc))
    except FileNotFoundError:
        state = f"has no {CONFIG}"
        if not _exists(folder):
            state = f"does not exist (nothing at {folder}, so it has no {CONFIG})"
        raise ConfigError(
            f"invalid config: model.hf_path={path!r} {state}; valid: the folder or URI of a "
            "Hugging Face checkpoint (config.json, model*.safetensors)"
        ) from None
    except ValueError as e:
        raise ConfigError(f"invalid config: {loc} is not JSON ({e})") from None


def _exists(loc: storage.Location) -> bool:
    try:
        return storage.exists(loc)
    except (OSError, ValueError):  # not listable: say what is known, that config.json is not
        return True


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
    cfg: ModelConfig,
    dtype: torch.dtype,
    eos_id: Optional[Union[int, list[int]]] = None,
    bos_id: Optional[int] = None,
) -> dict:
    """The config.json of our model in its family's transformers format."""
    return family_of(cfg).to_hf(cfg, dtype, eos_id, bos_id)


def special_ids(path: str, hf: Optional[dict] = None) -> dict:
    """{"bos_token_id", "eos_token_id"} of the Hugging Face checkpoint at `path`:
    generation_config.json's where it has them (Llama 3 instruct: every id that ends a turn),
    else config.json's (`hf`, when already read); None for what neither names. Empty when
    neither file is readable (an export falls back on it: a missing source is no error)."""
    found: dict = {}
    for name, given in ((CONFIG, hf), (GENERATION_CONFIG, None)):
        try:
            loc = storage.resolve(path).child(name)
            data = given if given is not None else json.loads(storage.read_bytes(loc))
        except (OSError, ValueError):  # StorageError is an OSError
            continue
        if not isinstance(data, dict):
            continue
        # A vision-language config.json (transformers 5) keeps them in its text_config.
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
        for key in ("bos_token_id", "eos_token_id"):
            value = data[key] if data.get(key) is not None else text.get(key)
            if value is not None:
                found[key] = value  # generation_config.json, read last, wins
    if not found:
        return {}
    return {"bos_token_id": found.get("bos_token_id"), "eos_token_id": found.get("eos_token_id")}


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our model's parameters and shapes, without building it."""
    return family_of(cfg).shapes(cfg)


def ordered_params(cfg: ModelConfig) -> list[str]:
    """Our parameters in transformers' order (embedding, blocks, norm, head)."""
    names = list(expected_tensors(cfg))
    first = ["tok_embeddings.weight"]
    last = ["norm.weight"] + ([] if cfg.tie_embeddings else ["output.weight"])
    return first + [n for n in names if n not in first + last] + last
