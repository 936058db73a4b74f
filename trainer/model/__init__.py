"""The model: the decoder of the Llama family and its relatives (decoder.py).

Pure torch, no sharding code: the engine (trainer/fsdp) wraps it by itself.
"""

from .decoder import (
    Attention,
    AttentionContext,
    FeedForward,
    KVCache,
    OutputHead,
    Positions,
    RMSNorm,
    RotaryEmbedding,
    Transformer,
    TransformerBlock,
    attend,
    build_model,
    count_params,
    document_ids,
    document_mask,
    flops_per_token,
    init_parameters,
    initializer,
    llama3_frequencies,
    loss_sum,
    projected_loss_sum,
)

__all__ = [
    "Attention",
    "AttentionContext",
    "FeedForward",
    "KVCache",
    "OutputHead",
    "Positions",
    "RMSNorm",
    "RotaryEmbedding",
    "Transformer",
    "TransformerBlock",
    "attend",
    "build_model",
    "count_params",
    "document_ids",
    "document_mask",
    "flops_per_token",
    "init_parameters",
    "initializer",
    "llama3_frequencies",
    "loss_sum",
    "projected_loss_sum",
]
