"""The image tower of a vision-language model (Qwen2-VL's ViT): pixels in, one decoder-width
feature per merged square of patches out.

    tower = VisionTower(cfg)                  # cfg: a ModelConfig with `vision`
    features = tower(pixels, grid)            # [N, C*T*P*P], [[t, h, w], ...] -> [N / 4, cfg.dim]

`pixels` are the image processor's pixel_values: every image's patches in turn, each square of
spatial_merge_size x spatial_merge_size patches consecutive, each patch flattened as
(channel, frame, row, column); `grid` holds each image's (t, h, w) in patches (image_grid_thw).

- The patch embedding is Conv3d with its stride equal to its kernel, so it is one matmul over
  the flattened patches; its weight keeps the checkpoint's shape [dim, C, T, P, P].
- A block is called as `block(x, ctx) -> x` with x [N, dim] (all patches of all images) and the
  forward's VisionContext (rotary tables, which patches attend together): it reads only its own
  parameters, so the engine may make each block a unit and checkpoint its activations.
- Attention is full (not causal) inside each image frame and never across images; frames of
  the same size run as one batched attention call.
- The rotary embedding rotates the two halves of each head (transformers' layout), the first
  half's frequencies by the patch's row and the second's by its column; unlike the decoder's
  interleaved pairs, so the tower's tensors load exactly as they are saved (no row permutation).
- The merger: LayerNorm, each square of merge**2 patches concatenated into one row, then
  Linear, GELU, Linear to the decoder's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, VisionConfig
from .initialization import linear


@dataclass
class VisionContext:
    """What every vision block shares in one forward: the rotary tables of each patch and the
    groups of patches that attend together."""

    cos: torch.Tensor
    """[N, head_dim] fp32 (sin alike): the angles of each patch's row and column."""
    sin: torch.Tensor
    groups: list[tuple[int, Optional[torch.Tensor]]]
    """(frame length L, the indices of every frame of that length, [m * L]; None when all N
    patches are frames of length L in order) for each length present."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, hd] -> [N, heads, hd], attention inside each frame only."""
        if not self.groups:  # no image: empty, but still part of the graph (every unit runs)
            return v
        outs, order = [], []
        for length, idx in self.groups:
            parts = (x if idx is None else x[idx] for x in (q, k, v))
            qs, ks, vs = (x.unflatten(0, (-1, length)).transpose(1, 2) for x in parts)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).flatten(0, 1))
            order.append(idx)
        if len(outs) == 1 and order[0] is None:
            return outs[0]
        inverse = torch.empty_like(perm := torch.cat(order))
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return torch.cat(outs)[inverse]


def vision_context(vision: VisionConfig, grid: list[list[int]], device) -> VisionContext:
    """The VisionContext of images with grids `grid` ((t, h, w) in patches each)."""
    m, half = vision.spatial_merge_size, vision.head_size // 2
    rows, cols, lengths = [], [], []
    for t, h, w in grid:
        r = torch.arange(h, device=device)[:, None].expand(h, w)
        c = torch.arange(w, device=device)[None, :].expand(h, w)
        # Block-major, as the patches come: each m x m square's patches consecutive.
        rows.append(r.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        cols.append(c.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        lengths += [h * w] * t
    inv_freq = 1.0 / (
        vision.rope_theta ** (torch.arange(0, half, 2, device=device, dtype=torch.float32) / half)
    )
    if rows:
        rc = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1).float()  # [N, 2]
    else:
        rc = torch.zeros(0, 2, device=device)
    angles = (rc[..., None] * inv_freq).flatten(1)  # [N, half]: rows' frequencies, then columns'
    angles = torch.cat([angles, angles], dim=-1)
    return VisionContext(angles.cos(), angles.sin(), frame_groups(lengths, device))


def frame_groups(lengths: list[int], device) -> list[tuple[int, Optional[torch.Tensor]]]:
    """VisionContext.groups of frames of these lengths, in order."""
    if len(set(lengths)) == 1:
        return [(lengths[0], None)]
    starts, at = {}, 0
    for n in lengths:
        starts.setdefault(n, []).append(at)
        at += n
    return [
        (n, (torch.tensor(s, device=device)[:, None] + torch.arange(n, device=device)).flatten())
        for n, s in starts.items()
    ]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotary(x: torch.Tensor, ctx: VisionContext) -> torch.Tensor:
    """x [N, heads, hd] rotated by each patch's row and column, in fp32 as transformers does."""
    xf = x.float()
    cos, sin = ctx.cos[:, None, :], ctx.sin[:, None, :]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class PatchEmbed(nn.Module):
    """Each flattened patch (C x T x P x P numbers) -> dim, without bias: Conv3d's weight
    [dim, C, T, P, P] used as a matrix (stride = kernel: the convolution is this matmul)."""

    def __init__(self, vision: VisionConfig, init_std: float):
        super().__init__()
        v = vision
        shape = (v.dim, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        self.weight = nn.Parameter(torch.empty(shape))
        self.init_std = init_std

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.weight.flatten(1)
        return F.linear(pixels.to(w.dtype), w)


class VisionAttention(nn.Module):
    """Full attention inside each frame: one query/key/value projection (with biases), the
    2-D rotary embedding on queries and keys, an output projection."""

    def __init__(self, vision: VisionConfig, init_std: float):
        super().__init__()
        self.n_heads, self.head_dim = vision.n_heads, vision.head_size
        self.qkv = linear(vision.dim, 3 * vision.dim, init_std, bias=True)
        self.proj = linear(vision.dim, vision.dim, init_std, bias=True)

    def forward(self, x: torch.Tensor, ctx: VisionContext) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        out = ctx.attend(rotary(q, ctx), rotary(k, ctx), v)
        return self.proj(out.reshape(n, self.n_heads * self.head_dim))


class VisionMlp(nn.Module):
    """fc2(quick_gelu(fc1 x)), with biases (QuickGELU: x * sigmoid(1.702 x), as CLIP's)."""

    def __init__(self, vision: VisionConfig, init_std: float):
        super().__init__()
        self.fc1 = linear(vision.dim, vision.ffn_dim, init_std, bias=True)
        self.fc2 = linear(vision.ffn_dim, vision.dim, init_std, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


class VisionBlock(nn.Module):
    """Pre-norm residual block: `block(x, ctx) -> x`, x [N, dim]."""

    def __init__(self, vision: VisionConfig, init_std: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(vision.dim, eps=vision.norm_eps)
        self.attn = VisionAttention(vision, init_std)
        self.norm2 = nn.LayerNorm(vision.dim, eps=vision.norm_eps)
        self.mlp = VisionMlp(vision, init_std)

    def forward(self, x: torch.Tensor, ctx: VisionContext) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), ctx)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, each square of merge**2 consecutive patches as one row, Linear, GELU, Linear:
    [N, dim] -> [N / merge**2, out_dim]."""

    def __init__(self, vision: VisionConfig, out_dim: int, init_std: float):
        super().__init__()
        self.merge, self.width = vision.merge_tokens, vision.dim * vision.merge_tokens
        self.norm = nn.LayerNorm(vision.dim, eps=vision.norm_eps)
        self.fc1 = linear(self.width, self.width, init_std, bias=True)
        self.fc2 = linear(self.width, out_dim, init_std, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.norm(x).view(x.shape[0] // self.merge, self.width)  # no image: 0 rows
        return self.fc2(F.gelu(self.fc1(rows)))


class VisionTower(nn.Module):
    """pixels [N, C*T*P*P] and grids [[t, h, w], ...] -> features [N / merge**2, cfg.dim], the
    images' merged patches in order. Parameters: patch_embed, blocks.<i>, merger."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.vision = v = cfg.vision
        self.patch_embed = PatchEmbed(v, cfg.init_std)
        self.blocks = nn.ModuleList(VisionBlock(v, cfg.init_std) for _ in range(v.depth))
        self.merger = PatchMerger(v, cfg.dim, cfg.init_std)

    def forward(self, pixels: torch.Tensor, grid: list[list[int]]) -> torch.Tensor:
        check_pixels(self.vision, pixels, grid)
        x = self.patch_embed(pixels)
        ctx = vision_context(self.vision, grid, x.device)
        for block in self.blocks:
            x = block(x, ctx)
        return self.merger(x)


def check_pixels(vision: VisionConfig, pixels: torch.Tensor, grid: list[list[int]]) -> None:
    """ValueError unless `pixels` are the patches of images with these grids."""
    m = vision.spatial_merge_size
    for i, (t, h, w) in enumerate(grid):
        if min(t, h, w) <= 0 or h % m or w % m:
            raise ValueError(
                f"image_grid[{i}] = {[t, h, w]}; valid: positive (t, h, w) with h and w "
                f"multiples of model.vision.spatial_merge_size={m}"
            )
    patches = sum(t * h * w for t, h, w in grid)
    if pixels.dim() != 2 or tuple(pixels.shape) != (patches, vision.patch_features):
        raise ValueError(
            f"pixels of shape {list(pixels.shape)}; valid: [{patches}, {vision.patch_features}] "
            f"(the patches of image_grid's images, each channels x temporal_patch_size x "
            "patch_size**2 numbers, as the image processor's pixel_values)"
        )
