"""The vision-language model (Qwen2-VL): the decoder and an image tower; each image's merged
patch features take the place of its image tokens, and every token has three rotary positions.

    model = build_model(cfg)                      # cfg.vision set: a VisionLanguageModel
    logits = model(tokens, pixels=pixel_values, image_grid=image_grid_thw)
    loss, count = model(tokens, positions, pixels=..., image_grid=..., targets=targets)

- Images in tokens: an image of grid (t, h, w) patches is a run of t*h*w / merge**2 tokens
  `vision.image_token_id`; the images are in the order of those runs (batch rows, then tokens),
  `pixels` and `image_grid` as the image processor gives them (pixel_values, image_grid_thw).
- `positions` keeps the decoder's meaning (each token's position in its packed document: the
  document mask). The three rotary positions are computed per document as transformers'
  get_rope_index does: text tokens have three equal positions, counting on; an image starting
  at position s has tokens at (s + frame, s + row, s + column) in merged patches, and the text
  after it continues from s + max(rows, columns) (an image, one frame: its largest position
  + 1). Without images the three are the decoder's positions: the Qwen2 decoder's rotation.
- Parameters: the decoder's names unchanged (tok_embeddings, layers.<i>, norm, output), the
  tower at `visual` (visual.patch_embed, visual.blocks.<i>, visual.merger).
- The tower runs in every forward without a KV cache, on no patches when a micro-batch has no
  image: every rank of the engine then runs the same units in the same order whatever its
  micro-batch holds (a unit gathered on one rank and not on another would hang the collectives).
- Generation: the prefill keeps cache.rope_delta (largest position + 1 - prompt length, as
  transformers' rope_deltas), and each new token is at its index + rope_delta.
- Not with context parallelism (context_split) nor experts (ModelConfig.validate refuses them).
"""

from __future__ import annotations

from typing import Optional

import torch

from .attention import AttentionContext, KVCache, document_mask
from .config import ModelConfig, VisionConfig
from .decoder import Transformer
from .vision import VisionTower


class VisionLanguageModel(Transformer):
    """The decoder (Transformer) with the image tower `visual`. Called as
    `model(tokens, positions=None, cache=None, *, pixels=None, image_grid=None, targets=None,
    loss_weight=None, loss_chunk_tokens=0, real=None)`: pixels [N, C*T*P*P] and image_grid
    [n, 3] (t, h, w) of the images whose tokens are in `tokens`; the rest as the decoder's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = VisionTower(cfg)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        *,
        pixels: Optional[torch.Tensor] = None,
        image_grid: Optional[torch.Tensor] = None,
        targets: Optional[torch.Tensor] = None,
        loss_weight=None,
        loss_chunk_tokens: int = 0,
        real: Optional[torch.Tensor] = None,
    ):
        if self.context_split is not None:
            raise ValueError("a vision-language model does not run with context parallelism")
        if (pixels is None) != (image_grid is None):
            raise ValueError("pixels and image_grid go together: both or neither")
        grid = [] if image_grid is None else [[int(x) for x in g] for g in image_grid.tolist()]
        prefill = cache is None or cache.length == 0
        if grid and not prefill:
            raise ValueError("images are read with the prompt (the KV cache's first forward)")
        features = None
        if prefill:  # every forward but a decoding step: the tower runs, images or none
            if pixels is None:
                pixels = torch.zeros(0, self.cfg.vision.patch_features, device=tokens.device)
            features = self.visual(pixels, grid)
        h = self.tok_embeddings(tokens)
        ctx = self.context(tokens, positions, cache, h.dtype, grid)
        if features is not None:
            mask = (tokens == self.cfg.vision.image_token_id)[..., None]
            h = h.masked_scatter(mask, features.to(h.dtype))
        return self.decode(h, ctx, real, targets, loss_weight, loss_chunk_tokens)

    def context(self, tokens, positions, cache, dtype, grid=()) -> AttentionContext:
        """The forward's AttentionContext: rotary tables at the three positions of each token
        (`rope_index`), the document mask when `positions` are given, the KV cache."""
        if positions is not None and cache is not None:
            raise ValueError("Transformer: positions (documents) and a KV cache do not mix")
        b, t = tokens.shape
        if cache is not None and cache.length > 0:  # decoding: after the prompt's positions
            span = cache.length + t
            steps = torch.arange(cache.length, span, device=tokens.device)
            delta = cache.rope_delta if cache.rope_delta is not None else 0
            three = steps[None, :] + torch.as_tensor(delta, device=tokens.device).view(-1, 1)
            three = three.expand(b, t)[None].expand(3, b, t)
        else:
            three = rope_index(tokens, positions, list(grid), self.cfg.vision)
            span = t
            if cache is not None:
                cache.rope_delta = three.amax(dim=(0, 2)) + 1 - t
        sections = self.cfg.mrope_section
        cos_sin = self.rotary.at_mrope(three, sections, tokens.device, dtype, span)
        mask = None if positions is None else document_mask(positions)
        return AttentionContext(cos_sin, mask, cache)


def rope_index(
    tokens: torch.Tensor,
    positions: Optional[torch.Tensor],
    grid: list[list[int]],
    vision: VisionConfig,
) -> torch.Tensor:
    """The three rotary positions [3, B, T] (temporal, row, column) of `tokens` [B, T] holding
    the images of `grid` as runs of image tokens, each document (`positions` restarting at 0;
    None: one per row) counted from 0 as transformers' get_rope_index counts a sequence.

    Vectorised: a token's base position is its position in its document less what the images
    before it in that document saved (an image of n tokens advances the positions by
    max(rows, columns), not n); an image's token k then sits at its start plus k's
    (frame, row, column) inside the image. A ValueError when the image tokens are not the
    images' (their number, or an image cut by a row or a document)."""
    b, t = tokens.shape
    device = tokens.device
    if positions is None:
        positions = torch.arange(t, device=device).expand(b, t)
    is_image = tokens == vision.image_token_id
    m = vision.spatial_merge_size
    sizes = [(gt, gh // m, gw // m) for gt, gh, gw in grid]
    counts = [gt * gh * gw for gt, gh, gw in sizes]
    found = int(is_image.sum())
    if found != sum(counts):
        given = f"the images given take {sum(counts)} ({counts} each)"
        raise ValueError(
            f"{found} image tokens (model.vision.image_token_id={vision.image_token_id}) in the "
            f"tokens, but {given if grid else 'no image is given (pixels, image_grid)'}; an "
            "image of grid (t, h, w) takes t*h*w / spatial_merge_size**2"
        )
    if not grid:
        return positions[None].expand(3, b, t)
    size = torch.tensor(sizes, device=device)  # [n, 3] merged (t, h, w)
    count = torch.tensor(counts, device=device)
    end = count.cumsum(0)
    k_all = torch.arange(found, device=device)
    image = torch.searchsorted(end, k_all, right=True)  # the image of each image token, in order
    k = k_all - (end - count)[image]  # the token's index inside its image
    h, w = size[image, 1], size[image, 2]
    frame, row, col = k // (h * w), (k // w) % h, k % w
    advance = torch.maximum(size[:, 1], size[:, 2])
    last = k == count[image] - 1
    saved = torch.zeros(b, t, dtype=torch.long, device=device)
    saved[is_image] = torch.where(last, count[image] - advance[image], 0)
    before = saved.cumsum(1) - saved  # saved by the images before each token (in its row)
    columns = torch.arange(t, device=device).expand(b, t)
    starts = torch.where(positions == 0, columns, 0).cummax(dim=1).values  # its document's start
    base = positions - (before - before.gather(1, starts))
    _check_runs(is_image, positions, columns, k)
    start = base[is_image] - k
    three = base[None].repeat(3, 1, 1)
    three[:, is_image] = torch.stack([start + frame, start + row, start + col])
    return three


def _check_runs(is_image, positions, columns, k) -> None:
    """ValueError unless each image's tokens are one run inside one row and one document."""
    cut = (columns[is_image] - k).diff() != 0  # a run starts where its first token is
    cut_inside = cut & (k[1:] != 0)
    starts_doc = (positions[is_image] == 0) & (k != 0)
    if bool(cut_inside.any() | starts_doc.any()):
        raise ValueError(
            "an image's tokens are not one run inside one row and one document; valid: each "
            "image's t*h*w / merge**2 image tokens consecutive, in image_grid's order"
        )
