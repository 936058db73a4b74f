"""The decoder of the Llama family and its relatives: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU; Qwen2's query/key/value biases, Qwen3's per-head query/key norms and decoupled
head width, Mistral as Llama (ModelConfig.family, qkv_bias, qk_norm, head_dim).

Pure torch and no distributed code: the engine (trainer/fsdp) wraps `model.layers[i]` (one unit
per block) and the rest (the root unit) by itself. What it relies on here:

- Stable names: `tok_embeddings`, `layers.<i>.{attention_norm, attention.{wq,wk,wv,wo,q_norm,
  k_norm}, ffn_norm, feed_forward.{w1,w2,w3}}`, `norm`, `output`. Biases only on wq/wk/wv
  (qkv_bias). No buffers.
- A block is called as `block(x, ctx) -> x` with x of shape [B, T, dim] and the forward's
  AttentionContext (rotary tables at the tokens' positions, the document mask, the KV cache):
  one tensor out, so the engine may replace its forward with an activation-checkpointed call.
  A block reads only its own parameters; the rotary tables are cached in a plain dict (not a
  buffer), so a model built on the meta device holds nothing but parameters.
- Documents: `model(tokens, positions)` with positions restarting at 0 for each packed document
  keeps attention inside each one (a dense mask for SDPA on the CPU, a FlexAttention block mask
  on CUDA) and restarts the rotary positions.
- `build_model(cfg)` builds on the meta device (the 8B model allocates nothing);
  `init_parameters(unit, seed, prefix)` (initialization.py) fills any materialised sub-module
  deterministically from (seed, fully-qualified parameter name) alone, so per-unit and
  whole-model init agree.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.loss import projected_loss_sum

from .attention import Attention, AttentionContext, KVCache, document_mask
from .config import ModelConfig
from .context import ContextSplit
from .feedforward import FeedForward
from .moe import LoadBalance, MoE
from .norms import RMSNorm
from .rotary import RotaryEmbedding


class TransformerBlock(nn.Module):
    """Pre-norm residual block. Called as `block(x, ctx) -> x`, x: [B, T, dim]; `ctx` (the
    forward's AttentionContext) may be left out for plain causal attention at positions 0..T-1."""

    def __init__(self, cfg: ModelConfig, rotary: Optional[RotaryEmbedding] = None, layer: int = 0):
        super().__init__()
        if rotary is None:
            rotary = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, rotary, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if layer in cfg.sparse_layers:  # a mixture of experts instead of the SwiGLU
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, ctx: Optional[AttentionContext] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), ctx)
        if hasattr(self, "moe"):
            return h + self.moe(self.ffn_norm(h), None if ctx is None else ctx.real)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputHead(nn.Module):
    """The output projection (weight [vocab, dim], no bias): `head(h)` -> logits, or
    `head(h, targets, weight, chunk)` -> (loss sum, count) straight from the hidden states,
    chunk tokens at a time (trainer/loss.py), so the full logits never exist. The loss is
    computed inside this module's own forward because a sharding engine gathers its weight
    around that call (our head unit, FSDP2's fully_shard): read outside it, there is none."""

    def __init__(self, dim: int, vocab_size: int, init_std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.init_std = init_std

    def forward(self, h: torch.Tensor, targets=None, weight=None, chunk: int = 0):
        if targets is None:
            return F.linear(h, self.weight)
        return projected_loss_sum(h, self.weight, targets, weight, chunk)

    def extra_repr(self) -> str:
        vocab, dim = self.weight.shape
        return f"dim={dim}, vocab_size={vocab}"


class Transformer(nn.Module):
    """tokens [B, T] (int64) -> logits [B, T, vocab] in the compute dtype; with `targets`
    [B, T] -> (the fp32 token-loss sum, tokens counted) as trainer/loss.py's loss_sum gives, the
    head and the loss computed `loss_chunk_tokens` tokens at a time (0: from the whole logits),
    `loss_weight` the micro-batch's number or per-token weights.

    `positions` [B, T]: each token's position inside its document, a 0 starting the next one
    (packed fine-tuning windows, data.document_mask): attention stays inside each document and
    the rotary embedding uses these positions. `cache`: a KVCache to append to (generation).

    With `context_split` set (context parallelism) a forward with `targets` is given the whole
    micro-batch and computes this rank's two chunks of it (trainer/model/context.py): the loss
    sum and count are over those tokens. Without targets it computes every token (logits of the
    whole sequence, as generation and evaluation of logits expect)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # One rotary table cache shared by all blocks (tables are identical across layers).
        self.rotary = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_embeddings.init_std = cfg.init_std
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, self.rotary, i) for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # The sparse layers' load-balancing loss over the global batch (None: a dense model).
        sparse = [layer.moe for layer in self.layers if hasattr(layer, "moe")]
        self.balance = LoadBalance(sparse, cfg.router_aux_loss_coef) if sparse else None
        for moe in sparse:
            moe.balance = self.balance
        # Context parallelism (trainer/model/context.py): set by the engine when the mesh splits
        # sequences; a forward with targets then computes this rank's chunks only.
        self.context_split: Optional[ContextSplit] = None
        # Tied: the head reads the embedding matrix; there is no second parameter to keep equal.
        self.output = (
            None if cfg.tie_embeddings else OutputHead(cfg.dim, cfg.vocab_size, cfg.init_std)
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        *,
        targets: Optional[torch.Tensor] = None,
        loss_weight=None,
        loss_chunk_tokens: int = 0,
        real: Optional[torch.Tensor] = None,
    ):
        split = None
        if self.context_split is not None and targets is not None and cache is None:
            tokens, positions, targets, loss_weight, real, split = self.context_split.shard(
                tokens, positions, targets, loss_weight, real
            )
        h = self.tok_embeddings(tokens)
        if split is not None:  # this rank's chunks, at their positions in the whole sequence
            cos_sin = self.rotary.at(positions, tokens.device, h.dtype, span=split.padded)
            ctx = AttentionContext(cos_sin, split=split)
        else:
            ctx = self.context(tokens, positions, cache, h.dtype)
        return self.decode(h, ctx, real, targets, loss_weight, loss_chunk_tokens)

    def decode(self, h, ctx: AttentionContext, real, targets, loss_weight, loss_chunk_tokens):
        """The blocks, the final norm and the head on the input embeddings h [B, T, dim] (the
        rest of forward; a vision-language model's forward, multimodal.py, ends with it too)."""
        ctx.real = real
        for layer in self.layers:
            h = layer(h, ctx)
        if ctx.cache is not None:
            ctx.cache.length += h.shape[1]
        h = self.norm(h)
        if self.output is not None:  # untied: the head's own forward (its unit gathers it)
            if targets is None:
                return self.output(h)
            return self.output(h, targets, loss_weight, loss_chunk_tokens)
        if targets is None:  # tied: the embedding's matrix, which the root unit holds
            return F.linear(h, self.tok_embeddings.weight)
        return projected_loss_sum(
            h, self.tok_embeddings.weight, targets, loss_weight, loss_chunk_tokens
        )

    def context(self, tokens, positions, cache, dtype) -> AttentionContext:
        if positions is not None and cache is not None:
            raise ValueError("Transformer: positions (documents) and a KV cache do not mix")
        if positions is None:
            offset = 0 if cache is None else cache.length
            cos_sin = self.rotary.at((offset, tokens.shape[1]), tokens.device, dtype)
            return AttentionContext(cos_sin, None, cache)
        cos_sin = self.rotary.at(positions, tokens.device, dtype)
        return AttentionContext(cos_sin, document_mask(positions))
