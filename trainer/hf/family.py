"""What a model family provides to the interchange: its config.json mapping both ways, its
tensor names and its parameter shapes. A family is one value (`llama.LLAMA`); the registry that
looks one up by config.json's model_type is `config.FAMILIES` (llama, qwen2, qwen3, mistral,
qwen3_moe, mixtral, qwen2_vl). A new family is a module defining one more `Family`, registered
there: no function branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Union

import torch

from trainer.config import ModelConfig, fail
from trainer.hf.names import NameMap
from trainer.hf.stacked import StackedNames


@dataclass(frozen=True)
class Family:
    model_type: str
    """config.json's model_type, the registry key: 'llama'."""
    architecture: str
    """config.json's one architecture: 'LlamaForCausalLM'."""
    title: str
    """The family's name in messages: 'Llama' ("valid: the tensors of a Llama model")."""
    names: NameMap
    """Hugging Face tensor names <-> ours."""
    from_hf: Callable[[dict, str], dict[str, Any]]
    """(config.json, where it was read) -> ModelConfig fields (all but name and hf_path); a
    ConfigError naming the field and its value for anything our model cannot represent."""
    to_hf: Callable[
        [ModelConfig, torch.dtype, Optional[Union[int, list[int]]], Optional[int]], dict
    ]
    """(config, dtype, eos id or ids, bos id) -> the config.json transformers and vLLM read."""
    shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    """Our model's parameters and their shapes, without building it."""
    stacked: StackedNames = StackedNames([])
    """A mixture's stacked expert tensors, each many of theirs (trainer/hf/stacked.py)."""


def refuse(hf: dict, where: str, key: str, valid: str) -> NoReturn:
    """ConfigError: config.json (read at `where`) has a value of `key` we cannot represent."""
    fail(f"{where}: {key}", hf.get(key), valid)


def hf_rope(hf: dict) -> tuple[float, dict]:
    """(theta, scaling parameters) from either transformers 4's (rope_theta, rope_scaling) or
    transformers 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    merged = {**scaling, **params}
    merged.setdefault("rope_type", merged.pop("type", "default"))
    return float(theta), merged
