"""Parameter and FLOP counts, analytically from a ModelConfig (nothing is allocated).

    python -c "from trainer.config import PRESETS; from trainer.model import count_params; \
               print(count_params(PRESETS['8b']))"
"""

from __future__ import annotations

from .config import ModelConfig


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Exact parameter count, analytically (no allocation). `active`: those one token computes
    with (a mixture's router and its top-k experts, not all of them)."""
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
    return embeddings + blocks + cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / Chinchilla MFU convention.

    6 N for the matmuls, where N excludes the input embedding (a lookup, no FLOPs; the output
    projection is counted, tied or not) and counts a mixture's active parameters only (the
    router and top-k experts a token computes with), plus 12 * n_layers * dim * seq_len for
    attention scores and values (PaLM appendix B, 6 L H Q T * 2). Causal masking is NOT
    discounted, as in the convention, so MFU figures are comparable with published ones.
    """
    n = count_params(cfg, active=True) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq_len
