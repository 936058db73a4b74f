"""Rotary position embedding: Meta's interleaved pairs, with Llama 3.1's frequency scaling.

The cos/sin tables are cached in a plain dict, not a buffer, so a model built on the meta device
holds nothing but parameters. `Positions` says where the tokens are: consecutive from an offset
(plain and KV-cache forwards) or per token (packed documents, positions restarting at 0).
A vision-language model gives each token three positions (temporal, row, column: `at_mrope`),
each rotating its own section of the frequencies.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .config import ModelConfig


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

    def at(
        self, positions: Positions, device, dtype, span: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) shaped to rotate [B, T, heads, head_dim]: for T positions from `offset`
        (an int pair (offset, T)) or for per-token positions (a LongTensor [B, T]) below `span`
        (default T: a window's own positions; a context-parallel chunk's are the sequence's)."""
        if isinstance(positions, tuple):
            offset, t = positions
            cos, sin = self.tables(offset + t, device, dtype)
            return cos[None, offset:, None, :], sin[None, offset:, None, :]
        # Positions inside a window are below its length: the table of T rows covers them.
        cos, sin = self.tables(max(span, positions.shape[1]), device, dtype)
        return cos[positions][:, :, None, :], sin[positions][:, :, None, :]

    def at_mrope(
        self, positions: torch.Tensor, sections: list[int], device, dtype, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) shaped to rotate [B, T, heads, head_dim] by three positions per token
        (`positions` [3, B, T], each below `span`): frequency i (our pair i, dims 2i and 2i+1)
        turns by the temporal position in the first of `sections`, by the row in the second,
        by the column in the third (Qwen2-VL's multimodal rotary embedding). Three equal rows
        give what `at` gives for one."""
        cos, sin = self.tables(span, device, dtype)

        def pick(table: torch.Tensor) -> torch.Tensor:
            rows = table[positions].split(sections, dim=-1)  # 3 x [3, B, T, section]
            return torch.cat([part[k] for k, part in enumerate(rows)], dim=-1)[:, :, None, :]

        return pick(cos), pick(sin)

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
