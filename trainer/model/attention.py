"""Attention: causal grouped-query self-attention that takes document boundaries.

What every block's attention shares in one forward is its `AttentionContext`: the rotary tables
at the tokens' positions, the document mask (positions restarting at 0 start a new document; no
token attends across one: a dense mask for SDPA on the CPU, a FlexAttention block mask on CUDA)
and the `KVCache` when generating. Qwen2's query/key/value biases and Qwen3's per-head query/key
norms are options of `Attention` (ModelConfig.qkv_bias, qk_norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import SplitAttention
from .initialization import linear, residual_std
from .norms import RMSNorm
from .rotary import RotaryEmbedding


class KVCache:
    """Keys and values of every layer for generation: prefill, then one token at a time.

        cache = KVCache(cfg, batch=1, max_len=512, device=device, dtype=torch.bfloat16)
        logits = model(prompt, cache=cache)          # cache.length == prompt length
        logits = model(next_token, cache=cache)      # attends to everything cached

    The model's forward appends the tokens it is given; `length` grows after the last layer."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype: torch.dtype):
        shape = (cfg.n_layers, batch, max_len, cfg.kv_heads, cfg.head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0
        # A vision-language model's prompt images take fewer rotary positions than tokens: the
        # new tokens' positions are their index + rope_delta ([B], set by its prefill).
        self.rope_delta: Optional[torch.Tensor] = None

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this forward's k, v [B, T, kv, hd] at the cache's end; all keys/values so far."""
        t = k.shape[1]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KVCache: {end} tokens do not fit its max_len={self.max_len}")
        self.k[layer, :, self.length : end] = k.to(self.k.dtype)
        self.v[layer, :, self.length : end] = v.to(self.v.dtype)
        return self.k[layer, :, :end].to(k.dtype), self.v[layer, :, :end].to(v.dtype)


@dataclass
class AttentionContext:
    """What every block's attention shares in one forward: the rotary tables at the tokens'
    positions, the document mask (None: plain causal), and the KV cache when generating. Built
    once per forward by the Transformer; a block called alone (`block(x)`) makes a causal one."""

    cos_sin: tuple[torch.Tensor, torch.Tensor]
    mask: Optional[object] = None
    """None (causal), a bool Tensor [B, 1, T, T] (True = may attend) or a FlexAttention
    BlockMask (CUDA)."""
    cache: Optional[KVCache] = None
    real: Optional[torch.Tensor] = None
    """[B, T] bool, the tokens that are not padding (None: all): what the mixture of experts'
    routing statistics count (trainer/model/moe.py)."""
    split: Optional["SplitAttention"] = None
    """Context parallelism (trainer/model/context.py): this rank's chunks attend to the whole
    sequence's keys and values, gathered per layer; `mask` is then unused."""


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] -> the document of each token: a new one starts wherever the position is 0."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=1)


def document_mask(positions: torch.Tensor, block: Optional[bool] = None):
    """Causal attention inside each document, never across: a dense bool mask [B, 1, T, T] for
    scaled_dot_product_attention on the CPU (FlexAttention has no backward there), a block mask
    for compiled FlexAttention on CUDA (it skips the blocks that are masked out entirely).
    `block` forces one or the other (tests compare them on the CPU)."""
    doc = document_ids(positions)
    b, t = doc.shape
    if block if block is not None else positions.device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415 -- CUDA only

        def same_document_causal(batch, head, q, kv):
            return (doc[batch, q] == doc[batch, kv]) & (q >= kv)

        return create_block_mask(same_document_causal, b, None, t, t, device=positions.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


_flex = None


def _flex_attention(q, k, v, block_mask):
    """FlexAttention, compiled once (eager it materialises the whole score matrix)."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415 -- CUDA only

        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex(q, k, v, block_mask=block_mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, offset: int = 0):
    """q [B, H, Tq, hd] over k, v [B, H, Tk, hd]: causal (query i is at position offset + i),
    or by `mask` (see AttentionContext.mask)."""
    if mask is None:
        tq, tk = q.shape[2], k.shape[2]
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if tq == 1:  # one new token sees everything cached
            return F.scaled_dot_product_attention(q, k, v)
        allowed = torch.arange(tk, device=q.device)[None, :] <= (
            offset + torch.arange(tq, device=q.device)[:, None]
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    if torch.is_tensor(mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _flex_attention(q, k, v, mask)


class Attention(nn.Module):
    """Causal grouped-query self-attention (n_kv_heads key/value heads shared by n_heads), with
    Qwen2's query/key/value biases and Qwen3's per-head query/key RMSNorm when configured."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.head_size
        self.layer = layer  # its slot in a KVCache
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wq = linear(cfg.dim, q_dim, cfg.init_std, bias=cfg.qkv_bias)
        self.wk = linear(cfg.dim, kv_dim, cfg.init_std, bias=cfg.qkv_bias)
        self.wv = linear(cfg.dim, kv_dim, cfg.init_std, bias=cfg.qkv_bias)
        # Output projections write into the residual stream: scaled so its variance stays O(1).
        self.wo = linear(q_dim, cfg.dim, residual_std(cfg))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary

    def forward(self, x: torch.Tensor, ctx: Optional[AttentionContext] = None) -> torch.Tensor:
        b, t, _ = x.shape
        if ctx is None:
            ctx = AttentionContext(self.rotary.at((0, t), x.device, x.dtype))
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, ctx.cos_sin), self.rotary(k, ctx.cos_sin)
        offset = 0
        if ctx.cache is not None:
            offset = ctx.cache.length
            k, v = ctx.cache.append(self.layer, k, v)
        if ctx.split is not None:  # this rank's chunks over the whole sequence's K/V
            out = ctx.split.attend(q, k, v, self._repeat_kv, attend)
            return self.wo(out.reshape(b, t, -1))
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx.mask, offset)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, kv, hd] -> [B, T, heads, hd]; query head h uses kv head h // (heads // kv)."""
        rep = self.n_heads // self.n_kv_heads
        if rep == 1:
            return x
        b, t, kv, hd = x.shape
        return x[:, :, :, None, :].expand(b, t, kv, rep, hd).reshape(b, t, kv * rep, hd)
