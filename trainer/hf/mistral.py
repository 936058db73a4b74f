"""The Mistral family (MistralForCausalLM): Llama-shaped, tensor for tensor. Its head width may
be given apart from hidden_size / num_attention_heads (Mistral-Nemo: 128 with hidden 5120 and 32
heads), which our head_dim represents.

A `sliding_window` that is not null is refused by name: attention over the whole context is
what our model implements (Mistral 7B v0.1 used a 4096 window; v0.2 on set it to null).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import ModelConfig, fail
from trainer.hf.family import Family, refuse
from trainer.hf.llama import FULL_CONTEXT, NAMES, EosIds, decoder_fields, decoder_to_hf, shapes
from trainer.hf.names import NameMap


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Mistral config."""
    if hf.get("sliding_window") is not None:
        fail(f"{where}: sliding_window", hf["sliding_window"], f"null ({FULL_CONTEXT})")
    if hf.get("attention_bias"):
        refuse(hf, where, "attention_bias", "false (the model has no biases)")
    return dict(decoder_fields(hf, where, "mistral"), qkv_bias=False, qk_norm=False)


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers' MistralConfig fields of our model (no sliding window)."""
    out = decoder_to_hf(cfg, dtype, eos_id, bos_id, "MistralForCausalLM", "mistral")
    return {**out, "sliding_window": None, "attention_dropout": 0.0}


MISTRAL = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    title="Mistral",
    names=NameMap(NAMES),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
)
