"""The Llama family (LlamaForCausalLM): its config.json fields, its tensor names, its shapes.

Everything else is the same math on both sides: RMSNorm in fp32, SwiGLU, grouped-query
attention with query head h reading key/value head h // (heads / kv_heads), rotary embeddings
(in another row layout: trainer/hf/names.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from trainer.config import ModelConfig, fail
from trainer.hf.family import Family, hf_rope, refuse
from trainer.hf.names import NameMap

# (Hugging Face name, our name), {i} a block index.
NAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
]


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Llama config; anything our model cannot represent
    is a ConfigError naming the field and its value, never approximated."""
    if hf.get("hidden_act", "silu") != "silu":
        refuse(hf, where, "hidden_act", "silu (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(hf, where, key, "false (the model has no biases)")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        refuse(hf, where, "head_dim", f"hidden_size / num_attention_heads = {dim // heads}")
    theta, rope = hf_rope(hf)
    if rope.get("rope_type") not in ("default", "llama3"):
        fail(f"{where}: rope_scaling.rope_type", rope.get("rope_type"), "default (none) or llama3")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        fail(f"{where}: partial_rotary_factor", rope["partial_rotary_factor"], "1.0")
    llama3 = rope.get("rope_type") == "llama3"
    return dict(
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling="llama3" if llama3 else None,
        rope_factor=float(rope.get("factor", 8.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 8192)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def to_hf(
    cfg: ModelConfig, dtype: torch.dtype, eos_id: Optional[int] = None, bos_id: Optional[int] = None
) -> dict:
    """transformers' LlamaConfig fields of our model (the format transformers and vLLM read)."""
    rope_scaling = None
    if cfg.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our model's parameters and shapes, without building it."""
    hd = cfg.dim // cfg.n_heads
    kv = cfg.kv_heads * hd
    out = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "attention.wq.weight": (cfg.dim, cfg.dim),
                p + "attention.wk.weight": (kv, cfg.dim),
                p + "attention.wv.weight": (kv, cfg.dim),
                p + "attention.wo.weight": (cfg.dim, cfg.dim),
                p + "feed_forward.w1.weight": (cfg.ffn_dim, cfg.dim),
                p + "feed_forward.w3.weight": (cfg.ffn_dim, cfg.dim),
                p + "feed_forward.w2.weight": (cfg.dim, cfg.ffn_dim),
                p + "attention_norm.weight": (cfg.dim,),
                p + "ffn_norm.weight": (cfg.dim,),
            }
        )
    return out


LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    title="Llama",
    names=NameMap(NAMES),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
)
