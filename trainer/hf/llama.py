"""The Llama family (LlamaForCausalLM), and the Llama-shaped decoder every family here shares:
its config.json fields both ways, its tensor names, its shapes.

    fields = decoder_fields(hf, where, "qwen2")          # the ModelConfig fields all families share
    decoder_to_hf(cfg, dtype, eos, bos, "Qwen2ForCausalLM", "qwen2") | {...family's own keys}

Everything else is the same math on both sides: RMSNorm in fp32, SwiGLU, grouped-query
attention with query head h reading key/value head h // (heads / kv_heads), rotary embeddings
(in another row layout: trainer/hf/names.py). The other families (qwen2.py, qwen3.py,
mistral.py) add their own tensors and refusals on top of these.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from trainer.config import ModelConfig, fail
from trainer.hf.family import Family, hf_rope, refuse
from trainer.hf.names import NameMap

EosIds = Optional[Union[int, list[int]]]
"""config.json's eos_token_id: one id, every id that ends a turn, or unknown."""

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

FULL_CONTEXT = "attention over the whole context is what is implemented"
"""Why a sliding window is refused (every family's message says it)."""


def decoder_fields(
    hf: dict, where: str, family: str, default_head_dim: Optional[int] = None
) -> dict[str, Any]:
    """ModelConfig fields of a Llama-shaped Hugging Face config (all but qkv_bias, qk_norm, name
    and hf_path); anything our model cannot represent is a ConfigError naming the field and its
    value, never approximated. `default_head_dim`: the family's head_dim when config.json has
    none (Qwen3's is 128; the others' hidden_size / num_attention_heads)."""
    if hf.get("hidden_act", "silu") != "silu":
        refuse(hf, where, "hidden_act", "silu (SwiGLU)")
    if hf.get("mlp_bias"):
        refuse(hf, where, "mlp_bias", "false (the feed-forward has no biases)")
    for i, kind in enumerate(hf.get("layer_types") or []):
        if kind != "full_attention":
            fail(f"{where}: layer_types[{i}]", kind, f"full_attention ({FULL_CONTEXT})")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or default_head_dim
    theta, rope = hf_rope(hf)
    if rope.get("rope_type") not in ("default", "llama3"):
        fail(f"{where}: rope_scaling.rope_type", rope.get("rope_type"), "default (none) or llama3")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        fail(f"{where}: partial_rotary_factor", rope["partial_rotary_factor"], "1.0")
    llama3 = rope.get("rope_type") == "llama3"
    return dict(
        family=family,
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        # None when it is the usual width: a Llama of before head_dim keeps its model digest.
        head_dim=None if head_dim in (None, dim / heads) else head_dim,
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


def decoder_to_hf(
    cfg: ModelConfig,
    dtype: torch.dtype,
    eos_id: EosIds,
    bos_id: Optional[int],
    architecture: str,
    model_type: str,
) -> dict:
    """The config.json fields every Llama-shaped family spells the same way."""
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
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 4's spelling: transformers 5 and vLLM read it too.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our model's parameters and shapes, without building it (any family: the biases and the
    query/key norms appear when the config has them)."""
    hd = cfg.head_size
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    out = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        a = f"layers.{i}.attention."
        out.update({a + "wq.weight": (q, cfg.dim), a + "wk.weight": (kv, cfg.dim)})
        out[a + "wv.weight"] = (kv, cfg.dim)
        if cfg.qkv_bias:
            out.update({a + "wq.bias": (q,), a + "wk.bias": (kv,), a + "wv.bias": (kv,)})
        out[a + "wo.weight"] = (cfg.dim, q)
        if cfg.qk_norm:
            out.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        p = f"layers.{i}."
        if i in cfg.sparse_layers:  # a mixture of experts: the router and the stacked experts
            e, f = cfg.moe_experts, cfg.moe_ffn_dim
            out.update(
                {
                    p + "moe.router.weight": (e, cfg.dim),
                    p + "moe.experts.w1": (e, f, cfg.dim),
                    p + "moe.experts.w3": (e, f, cfg.dim),
                    p + "moe.experts.w2": (e, cfg.dim, f),
                }
            )
        else:
            out.update(
                {
                    p + "feed_forward.w1.weight": (cfg.ffn_dim, cfg.dim),
                    p + "feed_forward.w3.weight": (cfg.ffn_dim, cfg.dim),
                    p + "feed_forward.w2.weight": (cfg.dim, cfg.ffn_dim),
                }
            )
        out.update({p + "attention_norm.weight": (cfg.dim,), p + "ffn_norm.weight": (cfg.dim,)})
    return out


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Llama config."""
    if hf.get("attention_bias"):
        refuse(hf, where, "attention_bias", "false (the model has no biases)")
    return dict(decoder_fields(hf, where, "llama"), qkv_bias=False, qk_norm=False)


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers' LlamaConfig fields of our model (the format transformers and vLLM read)."""
    out = decoder_to_hf(cfg, dtype, eos_id, bos_id, "LlamaForCausalLM", "llama")
    return {**out, "attention_bias": False, "mlp_bias": False}


LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    title="Llama",
    names=NameMap(NAMES),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
)
