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
  `init_parameters(unit, seed, prefix)` fills any materialised sub-module deterministically from
  (seed, fully-qualified parameter name) alone, so per-unit and whole-model init agree.

    python -c "from trainer.config import PRESETS; from trainer.model import count_params; \
               print(count_params(PRESETS['8b']))"
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.loss import loss_sum as loss_sum  # re-exported: its home is now trainer/loss.py
from trainer.loss import projected_loss_sum

# ----------------------------------------------------------------------------- building blocks


def _linear(in_features: int, out_features: int, init_std: float, bias: bool = False) -> nn.Linear:
    """A Linear that carries its own init std (biases start at zero), so init works on any
    sub-module."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.init_std = init_std
    return layer


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (bf16 sums of squares lose too much)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding:
    """Rotary position embedding (Meta's interleaved pairs: dims 2i and 2i+1 rotate together).

    Deliberately not an nn.Module and not a buffer: the cos/sin tables are a pure function of
    (seq_len, device, dtype), computed on first use and cached in a plain dict, so a meta-device
    model has nothing to materialise but parameters and state_dicts hold only parameters.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[ModelConfig] = None):
        """`scaling`: a ModelConfig with rope_scaling='llama3' and its factors (None: plain)."""
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling if scaling is not None and scaling.rope_scaling else None
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        """(cos, sin), each [seq_len, head_dim // 2], for positions 0..seq_len-1."""
        key = (seq_len, torch.device(device), dtype)
        if key not in self._cache:
            # Normal tensors even if first called under inference_mode: a later training
            # forward must be able to save them for backward.
            with torch.inference_mode(False), torch.no_grad():
                half = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                inv_freq = 1.0 / (self.theta ** (half / self.head_dim))
                if self.scaling is not None:
                    inv_freq = llama3_frequencies(inv_freq, self.scaling)
                positions = torch.arange(seq_len, device=device, dtype=torch.float32)
                angles = torch.outer(positions, inv_freq)  # fp32: bf16 angles are far off
                self._cache[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self._cache[key]

    def at(self, positions: Positions, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) shaped to rotate [B, T, heads, head_dim]: for T positions from `offset`
        (an int pair (offset, T)) or for per-token positions (a LongTensor [B, T])."""
        if isinstance(positions, tuple):
            offset, t = positions
            cos, sin = self.tables(offset + t, device, dtype)
            return cos[None, offset:, None, :], sin[None, offset:, None, :]
        # Positions inside a window are below its length: the table of T rows covers them.
        cos, sin = self.tables(positions.shape[1], device, dtype)
        return cos[positions][:, :, None, :], sin[positions][:, :, None, :]

    def __call__(self, x: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """Rotate x of shape [B, T, heads, head_dim] by its position (0..T-1 by default)."""
        cos, sin = cos_sin or self.at((0, x.shape[1]), x.device, x.dtype)
        pairs = x.unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


Positions = Union[tuple[int, int], torch.Tensor]
"""(offset, length): consecutive positions; or a LongTensor [B, T] of per-token positions."""


def llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's rotary scaling: wavelengths longer than the pretraining context / low factor
    are stretched by `factor`, shorter than it / high factor kept, those between interpolated."""
    factor, old = cfg.rope_factor, cfg.rope_original_max_seq_len
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


# ----------------------------------------------------------------------------- attention context


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
        self.wq = _linear(cfg.dim, q_dim, cfg.init_std, bias=cfg.qkv_bias)
        self.wk = _linear(cfg.dim, kv_dim, cfg.init_std, bias=cfg.qkv_bias)
        self.wv = _linear(cfg.dim, kv_dim, cfg.init_std, bias=cfg.qkv_bias)
        # Output projections write into the residual stream: scaled so its variance stays O(1).
        self.wo = _linear(q_dim, cfg.dim, _residual_std(cfg))
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


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = _linear(cfg.dim, cfg.ffn_dim, cfg.init_std)
        self.w2 = _linear(cfg.ffn_dim, cfg.dim, _residual_std(cfg))
        self.w3 = _linear(cfg.dim, cfg.ffn_dim, cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, ctx: Optional[AttentionContext] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), ctx)
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
    the rotary embedding uses these positions. `cache`: a KVCache to append to (generation)."""

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
    ):
        h = self.tok_embeddings(tokens)
        ctx = self.context(tokens, positions, cache, h.dtype)
        for layer in self.layers:
            h = layer(h, ctx)
        if cache is not None:
            cache.length += tokens.shape[1]
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


def _residual_std(cfg: ModelConfig) -> float:
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


# ----------------------------------------------------------------------------- build and init


def build_model(cfg: ModelConfig, device="meta", seed: Optional[int] = None) -> Transformer:
    """The model on `device`; on meta (the default) nothing is allocated, even for 8B.

    On a real device the model is built on meta, materialised with `to_empty` and filled by
    `init_parameters(model, seed or 0)`: torch's default per-layer init is never run (it would
    be wasted work, and not keyed by name).
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        init_parameters(model, 0 if seed is None else seed)
    return model


def init_parameters(
    module: nn.Module, seed: int, prefix: str = "", exclude: Iterable[nn.Module] = ()
) -> None:
    """Fill every parameter of `module` from (seed, prefix + its local name) alone.

    Each parameter gets its own CPU generator seeded with crc32(f"{seed}:{fqn}"), draws in fp32
    on CPU and is copied into place, so the values do not depend on which sub-module is passed,
    the order of calls, the device or the parameter dtype:
    `init_parameters(model.layers[3], s, prefix="layers.3.")` equals that slice of
    `init_parameters(model, s)`. RMSNorm weights are 1; every Linear/Embedding is normal with the
    `init_std` it carries (wo and w2 scaled by 1/sqrt(2 n_layers)). Parameters of the modules in
    `exclude` are skipped (the engine's root unit excludes the blocks, which are separate units).
    Raises if a parameter is still on the meta device or has no init rule.
    """
    skip = {id(p) for m in exclude for p in m.parameters()}
    todo = [
        (prefix + name, p, _init_rule(mod, prefix + name))
        for name, p, mod in _named_params_with_owner(module)
        if id(p) not in skip
    ]
    for fqn, p, _ in todo:
        if p.is_meta:
            raise RuntimeError(
                f"init_parameters: parameter {fqn!r} is on the meta device; "
                "materialise it first (module.to_empty(device=...))"
            )
    with torch.no_grad():
        for fqn, p, std in todo:
            if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                _draw_into(p, fqn, seed, std)  # same values, without a second copy in memory
            else:
                p.copy_(_draw(fqn, seed, p.shape, std))


def initializer(seed: int) -> Callable[[nn.Module, str], None]:
    """init_fn(module, prefix) for the engine (trainer/fsdp.parallelize): it materialises meta
    parameters one module at a time and fills them with `init_parameters` under this seed."""
    return lambda module, prefix: init_parameters(module, seed, prefix)


def _named_params_with_owner(module: nn.Module):
    for mod_name, mod in module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            yield (f"{mod_name}.{p_name}" if mod_name else p_name), p, mod


def _init_rule(owner: nn.Module, fqn: str) -> Optional[float]:
    """None means ones (norm gains), 0.0 zeros (biases); a float is the std of a zero-mean
    normal."""
    if isinstance(owner, RMSNorm):
        return None
    if fqn.endswith(".bias"):
        return 0.0
    std = getattr(owner, "init_std", None)
    if std is None:
        raise ValueError(
            f"init_parameters: no init rule for {fqn!r} "
            f"(a {type(owner).__name__} without an init_std attribute)"
        )
    return float(std)


def _draw_into(p: torch.Tensor, fqn: str, seed: int, std: Optional[float]) -> None:
    if std is None:
        p.fill_(1.0)
    elif std == 0.0:
        p.zero_()
    else:
        p.normal_(0.0, std, generator=_generator(fqn, seed))


def _generator(fqn: str, seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))


def _draw(fqn: str, seed: int, shape: torch.Size, std: Optional[float]) -> torch.Tensor:
    if std is None:
        return torch.ones(shape)
    if std == 0.0:
        return torch.zeros(shape)
    return torch.empty(shape, dtype=torch.float32).normal_(
        0.0, std, generator=_generator(fqn, seed)
    )


# ----------------------------------------------------------------------------- accounting


def count_params(cfg: ModelConfig) -> int:
    """Exact parameter count, analytically (no allocation)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    attention = 2 * cfg.dim * q_dim + 2 * cfg.dim * kv_dim
    attention += (q_dim + 2 * kv_dim) if cfg.qkv_bias else 0
    attention += 2 * cfg.head_size if cfg.qk_norm else 0
    block = attention + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    embeddings = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.dim
    return embeddings + cfg.n_layers * block + cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / Chinchilla MFU convention.

    6 N for the matmuls, where N excludes the input embedding (a lookup, no FLOPs; the output
    projection is counted, tied or not), plus 12 * n_layers * dim * seq_len for attention scores
    and values (PaLM appendix B, 6 L H Q T * 2). Causal masking is NOT discounted, as in the
    convention, so MFU figures are comparable with published ones.
    """
    n = count_params(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq_len
