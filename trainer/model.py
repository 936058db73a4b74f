"""Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Pure torch and no distributed code: the engine (trainer/fsdp) wraps `model.layers[i]` (one unit
per block) and the rest (the root unit) by itself. What it relies on here:

- Stable names: `tok_embeddings`, `layers.<i>.{attention_norm, attention.{wq,wk,wv,wo},
  ffn_norm, feed_forward.{w1,w2,w3}}`, `norm`, `output`. No biases, no buffers.
- A block is called as `block(x) -> x` with x of shape [B, T, dim]: one tensor in, one out, so the
  engine may replace its forward with an activation-checkpointed call. A block reads only its own
  parameters; the rotary tables it needs are computed from positions inside forward and cached in
  a plain dict (not a buffer), so a model built on the meta device holds nothing but parameters.
- `build_model(cfg)` builds on the meta device (the 8B model allocates nothing);
  `init_parameters(unit, seed, prefix)` fills any materialised sub-module deterministically from
  (seed, fully-qualified parameter name) alone, so per-unit and whole-model init agree.

    python -c "from trainer.config import PRESETS; from trainer.model import count_params; \
               print(count_params(PRESETS['8b']))"
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

# ----------------------------------------------------------------------------- building blocks


def _linear(in_features: int, out_features: int, init_std: float) -> nn.Linear:
    """A bias-free Linear that carries its own init std, so init works on any sub-module."""
    layer = nn.Linear(in_features, out_features, bias=False)
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [B, T, heads, head_dim] by its position along T."""
        cos, sin = self.tables(x.shape[1], x.device, x.dtype)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        pairs = x.unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


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


class Attention(nn.Module):
    """Causal grouped-query self-attention (n_kv_heads key/value heads shared by n_heads)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = _linear(cfg.dim, cfg.dim, cfg.init_std)
        self.wk = _linear(cfg.dim, kv_dim, cfg.init_std)
        self.wv = _linear(cfg.dim, kv_dim, cfg.init_std)
        # Output projections write into the residual stream: scaled so its variance stays O(1).
        self.wo = _linear(cfg.dim, cfg.dim, _residual_std(cfg))
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.rotary(self.wq(x).view(b, t, self.n_heads, self.head_dim))
        k = self.rotary(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim))
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
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
    """Pre-norm residual block. Called as `block(x) -> x`, x: [B, T, dim]."""

    def __init__(self, cfg: ModelConfig, rotary: Optional[RotaryEmbedding] = None):
        super().__init__()
        if rotary is None:
            rotary = RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.rope_theta, cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, rotary)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [B, T] (int64) -> logits [B, T, vocab] in the compute dtype."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # One rotary table cache shared by all blocks (tables are identical across layers).
        rotary = RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.rope_theta, cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_embeddings.init_std = cfg.init_std
        self.layers = nn.ModuleList(TransformerBlock(cfg, rotary) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Tied: the head reads the embedding matrix; there is no second parameter to keep equal.
        self.output = None if cfg.tie_embeddings else _linear(cfg.dim, cfg.vocab_size, cfg.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)


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
    """None means ones (norm gains); a float is the std of a zero-mean normal."""
    if isinstance(owner, RMSNorm):
        return None
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
    else:
        p.normal_(0.0, std, generator=_generator(fqn, seed))


def _generator(fqn: str, seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))


def _draw(fqn: str, seed: int, shape: torch.Size, std: Optional[float]) -> torch.Tensor:
    if std is None:
        return torch.ones(shape)
    return torch.empty(shape, dtype=torch.float32).normal_(
        0.0, std, generator=_generator(fqn, seed)
    )


# ----------------------------------------------------------------------------- accounting


def count_params(cfg: ModelConfig) -> int:
    """Exact parameter count, analytically (no allocation)."""
    head_dim = cfg.dim // cfg.n_heads
    kv_dim = cfg.kv_heads * head_dim
    attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim
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
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq_len


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, weight=None):
    """(sum of token cross-entropies as an fp32 scalar, number of tokens counted).

    The caller divides by the GLOBAL token count of the step (data.global_tokens_per_step), so
    the gradient does not depend on how the batch was split over ranks and micro-batches.
    Cross-entropy is computed in fp32 even from bf16 logits. `weight` is None, a number (a
    micro-batch weight: 0.0 marks a padding micro-batch that must still run backward but adds
    nothing), or a tensor shaped like `targets` (per-token weights; tokens with weight 0 are not
    counted).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    if weight is None or not torch.is_tensor(weight):
        w = 1.0 if weight is None else float(weight)
        total = F.cross_entropy(flat_logits, flat_targets, reduction="sum") * w
        return total, (flat_targets.numel() if w != 0 else 0)
    per_token = F.cross_entropy(flat_logits, flat_targets, reduction="none")
    w = weight.reshape(-1).to(per_token.dtype)
    return (per_token * w).sum(), int((w != 0).sum())
