"""Parameter and FLOP counts, analytically from a ModelConfig (nothing is allocated).

    python -c "from trainer.config import PRESETS; from trainer.model import count_params; \
               print(count_params(PRESETS['8b']))"
"""

from __future__ import annotations

from .config import ModelConfig


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Exact parameter count, analytically (no allocation), a vision-language model's image
    tower included. `active`: those one token computes with (a mixture's router and its top-k
    experts, not all of them)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    attention = 2 * cfg.dim * q_dim + 2 * cfg.dim * kv_dim
    attention += (q_dim + 2 * kv_dim) if cfg.qkv_bias else 0
    attention += 2 * cfg.head_size if cfg.qk_norm else 0
    sparse = len(cfg.sparse_layers)
    experts = cfg.moe_top_k if active else cfg.moe_experts
    dense_ffn = (cfg.n_layers - sparse) * 3 * cfg.dim * cfg.ffn_dim
    moe = sparse * (cfg.moe_experts * cfg.dim + experts * 3 * cfg.dim * cfg.moe_ffn_dim)
    blocks = cfg.n_layers * (attention + 2 * cfg.dim) + dense_ffn + moe
    embeddings = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.dim
    return embeddings + blocks + cfg.dim + vision_params(cfg)


def vision_params(cfg: ModelConfig) -> int:
    """The image tower's parameters (trainer/model/vision.py); 0 without one."""
    v = cfg.vision
    if v is None:
        return 0
    return v.patch_features * v.dim + v.depth * _vision_block(cfg) + _merger(cfg)


def _vision_block(cfg: ModelConfig) -> int:
    d, f = cfg.vision.dim, cfg.vision.ffn_dim
    return 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (f * d + f) + (d * f + d)


def _merger(cfg: ModelConfig) -> int:
    width = cfg.vision.dim * cfg.vision.merge_tokens
    return 2 * cfg.vision.dim + (width * width + width) + (cfg.dim * width + cfg.dim)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the decoder, the PaLM / Chinchilla MFU
    convention (an image tower's are per patch: vision_flops_per_patch).

    6 N for the matmuls, where N excludes the input embedding (a lookup, no FLOPs; the output
    projection is counted, tied or not) and counts a mixture's active parameters only (the
    router and top-k experts a token computes with), plus 12 * n_layers * dim * seq_len for
    attention scores and values (PaLM appendix B, 6 L H Q T * 2). Causal masking is NOT
    discounted, as in the convention, so MFU figures are comparable with published ones.
    """
    n = count_params(cfg, active=True) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    n -= vision_params(cfg)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq_len


def vision_flops_per_patch(cfg: ModelConfig, frame_patches: int) -> float:
    """Training FLOPs per image patch of the tower (0 without one), in flops_per_token's
    convention: 6 x the patch embedding's and blocks' parameters, the merger's shared by the
    merge**2 patches of a token, and 12 x depth x dim x `frame_patches` for attention over the
    image's frame (full attention: every patch sees all `frame_patches`, h x w, of its frame)."""
    v = cfg.vision
    if v is None:
        return 0.0
    matmuls = v.patch_features * v.dim + v.depth * _vision_block(cfg)
    return 6.0 * (matmuls + _merger(cfg) / v.merge_tokens) + 12.0 * v.depth * v.dim * frame_patches
