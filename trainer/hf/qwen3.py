"""The Qwen3 family (Qwen3ForCausalLM): Llama with an RMSNorm over each query and key head
(`self_attn.q_norm.weight`, `k_norm.weight`, [head_dim], applied before the rotary embedding)
and a head width decoupled from hidden_size / num_attention_heads (Qwen3-0.6B: 128 with hidden
1024 and 16 heads). No biases (`attention_bias: true` would put one on the output projection
too: refused); a sliding window is refused as for Qwen2.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import ModelConfig
from trainer.hf.family import Family, refuse
from trainer.hf.llama import NAMES, EosIds, decoder_fields, decoder_to_hf, shapes
from trainer.hf.names import NameMap
from trainer.hf.qwen2 import qwen_to_hf, refuse_sliding_window

NORMS = [
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attention.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attention.k_norm.weight"),
]

DEFAULT_HEAD_DIM = 128
"""transformers' Qwen3Config head_dim when config.json names none."""


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Qwen3 config."""
    if hf.get("attention_bias"):
        refuse(hf, where, "attention_bias", "false (the model has no biases)")
    refuse_sliding_window(hf, where)
    fields = decoder_fields(hf, where, "qwen3", default_head_dim=DEFAULT_HEAD_DIM)
    return dict(fields, qkv_bias=False, qk_norm=True)


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers' Qwen3Config fields of our model (head_dim always spelled out)."""
    out = decoder_to_hf(cfg, dtype, eos_id, bos_id, "Qwen3ForCausalLM", "qwen3")
    return {**out, **qwen_to_hf(cfg), "attention_bias": False}


QWEN3 = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    title="Qwen3",
    names=NameMap(NAMES + NORMS),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
)
