"""The Qwen2 family (Qwen2ForCausalLM; Qwen2.5 checkpoints use it too): Llama with biases on the
query, key and value projections (never on the output projection), and often tied embeddings.

A sliding window (`use_sliding_window: true`) is refused by name: attention over the whole
context is what our model implements. With it false, config.json's `sliding_window` value is
unused by transformers too, so it is accepted.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import ModelConfig
from trainer.hf.family import Family, refuse
from trainer.hf.llama import FULL_CONTEXT, NAMES, EosIds, decoder_fields, decoder_to_hf, shapes
from trainer.hf.names import NameMap

BIASES = [
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.attention.wq.bias"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.attention.wk.bias"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.attention.wv.bias"),
]


def refuse_sliding_window(hf: dict, where: str) -> None:
    """Qwen2 and Qwen3 switch their window on with use_sliding_window (sliding_window is its
    width, unused while it is off)."""
    if hf.get("use_sliding_window"):
        refuse(
            hf,
            where,
            "use_sliding_window",
            f"false ({FULL_CONTEXT}, not a window of sliding_window={hf.get('sliding_window')!r})",
        )


def qwen_to_hf(cfg: ModelConfig) -> dict:
    """The sliding-window keys of a Qwen config: off, every layer attending to everything."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "attention_dropout": 0.0,
    }


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Qwen2 config (its q/k/v biases are always there)."""
    refuse_sliding_window(hf, where)
    return dict(decoder_fields(hf, where, "qwen2"), qkv_bias=True, qk_norm=False)


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers' Qwen2Config fields of our model."""
    out = decoder_to_hf(cfg, dtype, eos_id, bos_id, "Qwen2ForCausalLM", "qwen2")
    return {**out, **qwen_to_hf(cfg)}


QWEN2 = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    title="Qwen2",
    names=NameMap(NAMES + BIASES),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
)
