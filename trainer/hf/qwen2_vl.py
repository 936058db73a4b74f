"""The Qwen2-VL family (Qwen2VLForConditionalGeneration): the Qwen2 decoder with multimodal
rotary positions (rope mrope_section) and a ViT image tower (vision_config), ours
trainer/model/multimodal.py and vision.py.

    cfg = config_from_hf(read_hf_config("/models/Qwen2-VL-2B-Instruct"))   # cfg.vision set

config.json comes in two layouts, both read: transformers 4's flat one (the decoder's fields at
the top, rope_scaling {"type": "mrope", "mrope_section": [...]}, vision_config beside them) and
transformers 5's (the decoder's fields in text_config, its rope_parameters holding
mrope_section); an export writes transformers 5's, as its save_pretrained does.

Tensor names: published checkpoints, and transformers 5's save_pretrained, name the decoder as
Qwen2 does (model.layers.<i>..., model.embed_tokens, model.norm, lm_head) and the tower
`visual.*`; transformers 5 holds them in memory as model.language_model.* and model.visual.*,
which are read too. An export writes the published names.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import ModelConfig, fail
from trainer.hf.family import Family, refuse
from trainer.hf.llama import NAMES, EosIds, decoder_fields, decoder_to_hf
from trainer.hf.llama import shapes as decoder_shapes
from trainer.hf.names import NameMap
from trainer.hf.qwen2 import BIASES, qwen_to_hf, refuse_sliding_window
from trainer.model.config import VisionConfig

# (Hugging Face name under visual., ours under visual.), {i} a vision block.
VISION_NAMES = [
    ("patch_embed.proj.weight", "patch_embed.weight"),
    *(
        (f"blocks.{{i}}.{hf}.{kind}", f"blocks.{{i}}.{hf}.{kind}")
        for hf in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
        for kind in ("weight", "bias")
    ),
    ("merger.ln_q.weight", "merger.norm.weight"),
    ("merger.ln_q.bias", "merger.norm.bias"),
    ("merger.mlp.0.weight", "merger.fc1.weight"),
    ("merger.mlp.0.bias", "merger.fc1.bias"),
    ("merger.mlp.2.weight", "merger.fc2.weight"),
    ("merger.mlp.2.bias", "merger.fc2.bias"),
]

PUBLISHED = NAMES + BIASES + [(f"visual.{h}", f"visual.{o}") for h, o in VISION_NAMES]
"""The names of published checkpoints and of save_pretrained: an export writes these."""
IN_MEMORY = [
    (h.replace("model.", "model.language_model.", 1), o) for h, o in NAMES + BIASES
    if h.startswith("model.")
] + [(f"model.visual.{h}", f"visual.{o}") for h, o in VISION_NAMES]  # fmt: skip
"""transformers 5's own names (its state_dict): read, never written (the first match wins)."""

DEFAULT_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
"""Qwen2VLConfig's token ids when config.json names none."""
DEFAULT_MROPE = [16, 24, 24]
"""transformers' mrope_section when the rope parameters name none."""
DEFAULT_THETA = 1e6
"""Qwen2VLTextConfig's rope theta when config.json names none."""


def text_config(hf: dict) -> dict:
    """The decoder's fields of either layout: transformers 5's text_config over the top."""
    return {**hf, **(hf.get("text_config") or {})}


def from_hf(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face Qwen2-VL config (either layout)."""
    text = text_config(hf)
    refuse_sliding_window(text, where)
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        fail(f"{where}: rope_parameters.rope_type", kind, "default or mrope (no scaling)")
    theta = rope.get("rope_theta") or text.get("rope_theta") or DEFAULT_THETA
    plain = {k: v for k, v in text.items() if k not in ("rope_scaling", "head_dim")}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    fields = decoder_fields(plain, where, "qwen2_vl")
    tied = hf.get("tie_word_embeddings") or text.get("tie_word_embeddings")
    return dict(
        fields,
        qkv_bias=True,
        qk_norm=False,
        tie_embeddings=bool(tied),
        mrope_section=list(rope.get("mrope_section") or DEFAULT_MROPE),
        vision=vision_from_hf(hf, where, fields["dim"]),
    )


def vision_from_hf(hf: dict, where: str, dim: int) -> VisionConfig:
    """Our VisionConfig of config.json's vision_config and token ids."""
    v = hf.get("vision_config") or {}
    if v.get("hidden_act", "quick_gelu") != "quick_gelu":
        refuse(v, f"{where}: vision_config", "hidden_act", "quick_gelu (Qwen2-VL's tower)")
    if v.get("hidden_size", dim) != dim:
        refuse(v, f"{where}: vision_config", "hidden_size", f"the decoder's hidden_size={dim}")
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(v.get(key, 1), int):
            refuse(v, f"{where}: vision_config", key, "one integer")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        fail(f"{where}: vision_config.rope_parameters.rope_type", rope["rope_type"], "axial")
    embed = v.get("embed_dim", 1280)
    ids = {key: hf.get(key, default) for key, default in DEFAULT_IDS.items()}
    return VisionConfig(
        depth=v.get("depth", 32),
        dim=embed,
        n_heads=v.get("num_heads", 16),
        ffn_dim=int(embed * v.get("mlp_ratio", 4)),
        patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        norm_eps=1e-6,  # fixed in transformers' tower
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        **ids,
    )


def to_hf(cfg: ModelConfig, dtype: torch.dtype, eos_id: EosIds = None, bos_id=None) -> dict:
    """transformers 5's Qwen2VLConfig of our model (the layout its save_pretrained writes)."""
    if cfg.head_dim not in (None, cfg.dim // cfg.n_heads):
        fail("model.head_dim", cfg.head_dim, "null: Qwen2-VL's head width is dim // n_heads")
    if cfg.rope_scaling:
        fail("model.rope_scaling", cfg.rope_scaling, "null: Qwen2-VL has no rotary scaling")
    arch = "Qwen2VLForConditionalGeneration"
    base = decoder_to_hf(cfg, dtype, eos_id, bos_id, arch, "qwen2_vl")
    top = ("architectures", "model_type", "torch_dtype", "tie_word_embeddings")
    text = {k: v for k, v in base.items() if k not in top + ("rope_theta", "rope_scaling")}
    text.pop("head_dim")
    rope = {"rope_type": "default", "mrope_section": list(cfg.mrope_section)}
    text.update(qwen_to_hf(cfg), model_type="qwen2_vl_text", rope_parameters=rope)
    text["rope_parameters"]["rope_theta"] = cfg.rope_theta
    v = cfg.vision
    ids = {key: getattr(v, key) for key in DEFAULT_IDS if getattr(v, key) is not None}
    return {
        **{k: base[k] for k in top},
        "model_type": "qwen2_vl",
        **ids,
        "text_config": text,
        "vision_config": vision_to_hf(cfg),
    }


def vision_to_hf(cfg: ModelConfig) -> dict:
    """config.json's vision_config of our tower."""
    v = cfg.vision
    if v.ffn_dim % v.dim:
        valid = f"a multiple of model.vision.dim={v.dim} (config.json's mlp_ratio)"
        fail("model.vision.ffn_dim", v.ffn_dim, valid)
    if v.norm_eps != 1e-6:
        fail("model.vision.norm_eps", v.norm_eps, "1e-6 (fixed in transformers' Qwen2-VL tower)")
    return {
        "model_type": "qwen2_vl_vision",
        "depth": v.depth,
        "embed_dim": v.dim,
        "hidden_size": cfg.dim,
        "hidden_act": "quick_gelu",
        "mlp_ratio": v.ffn_dim // v.dim,
        "num_heads": v.n_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "initializer_range": cfg.init_std,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The decoder's parameters and the tower's (visual.*), with their shapes."""
    v = cfg.vision
    out = decoder_shapes(cfg)
    patch = (v.dim, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    out["visual.patch_embed.weight"] = patch
    for i in range(v.depth):
        b = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            out.update({b + norm + ".weight": (v.dim,), b + norm + ".bias": (v.dim,)})
        out.update({b + "attn.qkv.weight": (3 * v.dim, v.dim), b + "attn.qkv.bias": (3 * v.dim,)})
        out.update({b + "attn.proj.weight": (v.dim, v.dim), b + "attn.proj.bias": (v.dim,)})
        out.update({b + "mlp.fc1.weight": (v.ffn_dim, v.dim), b + "mlp.fc1.bias": (v.ffn_dim,)})
        out.update({b + "mlp.fc2.weight": (v.dim, v.ffn_dim), b + "mlp.fc2.bias": (v.dim,)})
    width = v.dim * v.merge_tokens
    out.update({"visual.merger.norm.weight": (v.dim,), "visual.merger.norm.bias": (v.dim,)})
    out.update({"visual.merger.fc1.weight": (width, width), "visual.merger.fc1.bias": (width,)})
    out.update({"visual.merger.fc2.weight": (cfg.dim, width), "visual.merger.fc2.bias": (cfg.dim,)})
    return out


QWEN2_VL = Family(
    model_type="qwen2_vl",
    architecture="Qwen2VLForConditionalGeneration",
    title="Qwen2-VL",
    names=NameMap(PUBLISHED + IN_MEMORY),
    from_hf=from_hf,
    to_hf=to_hf,
    shapes=shapes,
)
