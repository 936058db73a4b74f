"""The feed-forward of a block: SwiGLU (a mixture of experts will sit beside it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .initialization import linear, residual_std


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = linear(cfg.dim, cfg.ffn_dim, cfg.init_std)
        self.w2 = linear(cfg.ffn_dim, cfg.dim, residual_std(cfg))
        self.w3 = linear(cfg.dim, cfg.ffn_dim, cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
