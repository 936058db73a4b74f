"""The images of a chat preparation's windows, on disk: written beside a shard's tokens, read
back per window by the loader.

    order, records, firsts = layout(docs, bins)             # preparation (units.py)
    images = Images.open(data, "train")                      # the loader (loader.py): None
    pixels, grid = images.patches(sources, samples, tokens)  # without images; else tensors

Beside a shard `<name>.bin` that holds images (dataset.py's layout "windows"):

    <name>.img.bin    uint8: each image resized (images.py: RGB, smart_resize), [H, W, 3] row
                      by row, back to back in window order, inside a window in token order
    <name>.imgs.bin   int64 [n, 4] per image: byte offset in the .img.bin, t, h, w (its grid)
    <name>.wimg.bin   uint64 [windows + 1]: window w's images are [first[w], first[w + 1])

Each with its crc32 and element count in the shard's `files`. The stored image is the
processor's state just before its float steps (rescale, normalise, patchify), which the loader
does per micro-batch: 3 bytes a pixel on disk instead of the 24 of float32 patches with their
temporal repeat, and no decode or resize per step (benchmarks/images.py).
"""

from __future__ import annotations

import numpy as np
import torch

from .dataset import DataError, PreparedData, SplitIndex, TokenStream
from .images import ImageProcessing

IMAGE_KINDS = ("pixels", "images", "window_images")
"""The kinds of file (dataset.EXTRA_FILES) a shard with images has beside its tokens."""


def layout(docs: list, bins: list[list[int]]) -> tuple[list, np.ndarray, np.ndarray]:
    """(images in storage order, their int64 [n, 4] records, uint64 [windows + 1] window
    starts) of the documents `docs` (each with .images: chat_images.StoredImage) in `bins`."""
    order, firsts = [], [0]
    for members in bins:
        for i in members:  # a window's documents in the order build_windows places them
            order += docs[i].images
        firsts.append(len(order))
    records = np.zeros((len(order), 4), np.int64)
    offset = 0
    for row, image in enumerate(order):
        records[row] = (offset, *image.grid)
        offset += image.nbytes
    return order, records, np.asarray(firsts, np.uint64)


def has_images(data: PreparedData) -> bool:
    """Whether any window of a preparation holds an image."""
    splits = [sp for s in data.manifest.sources for sp in s.splits.values()]
    return any("pixels" in shard.files for sp in splits for shard in sp.shards)


class WindowImages:
    """One (source, split)'s images, by window: an index loaded at open (8 bytes a window, as
    the loss-token counts), then two ranged reads per window that holds images."""

    def __init__(self, data: PreparedData, source: int, split: str, patch_size: int):
        self.patch_size = patch_size
        shards = data.manifest.sources[source].splits[split].shards
        bounds, holding = [np.zeros(1, np.int64)], []
        self.shard_first, self.pixel_base = [], []
        images = nbytes = 0
        for shard in shards:
            if "pixels" not in shard.files:
                bounds.append(np.full(shard.windows, images, np.int64))
                continue
            stream = TokenStream(data.root, SplitIndex([shard.extra("window_images")]), np.uint64)
            try:
                first = stream.read(0, shard.windows + 1).astype(np.int64)
            finally:
                stream.close()
            bounds.append(first[1:] + images)
            self.shard_first.append(images)
            self.pixel_base.append(nbytes)
            images += int(first[-1])
            nbytes += shard.files["pixels"]["nbytes"]
            holding.append(shard)
        self.bounds = np.concatenate(bounds)
        """Window w's images: [bounds[w], bounds[w + 1]) over the split's image-holding shards."""
        self.records = TokenStream(
            data.root, SplitIndex([s.extra("images") for s in holding]), np.int64
        )
        self.pixels = TokenStream(
            data.root, SplitIndex([s.extra("pixels") for s in holding]), np.uint8
        )

    def count(self, window: int) -> int:
        return int(self.bounds[window + 1] - self.bounds[window])

    def read(self, window: int) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
        """(uint8 [H, W, 3], (t, h, w)) of each image of a window, in token order."""
        lo, hi = int(self.bounds[window]), int(self.bounds[window + 1])
        if lo == hi:
            return []
        records = self.records.read(lo * 4, (hi - lo) * 4).reshape(-1, 4)
        shard = int(np.searchsorted(self.shard_first, lo, side="right") - 1)
        p = self.patch_size
        sizes = (records[:, 2] * p) * (records[:, 3] * p) * 3
        start = self.pixel_base[shard] + int(records[0, 0])
        raw = self.pixels.read(start, int(sizes.sum()))
        out, at = [], 0
        for (_, t, h, w), size in zip(records.tolist(), sizes.tolist()):
            out.append((raw[at : at + size].reshape(h * p, w * p, 3), (t, h, w)))
            at += size
        return out

    def close(self) -> None:
        self.records.close()
        self.pixels.close()


class Images:
    """The images of a split's windows, for the loader: each micro-batch's patches and grids."""

    def __init__(self, data: PreparedData, split: str):
        settings = data.manifest.settings.get("images")
        if not settings:
            raise DataError(f"{data.root}: windows hold images, the manifest no image processor")
        self.processing = ImageProcessing.from_json(settings)
        self.pad_id = data.manifest.tokenizer.get("image_token_id")
        p = self.processing.patch_size
        self.sources = [WindowImages(data, i, split, p) for i in range(data.num_sources)]

    @classmethod
    def open(cls, data: PreparedData, split: str) -> "Images | None":
        """None when no window of the preparation holds an image (text-only data)."""
        return cls(data, split) if has_images(data) else None

    def patches(self, sources, samples, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [N, patch_dim], int64 [n, 3]) of the windows `samples` of `sources` (rows of
        `tokens`), in the order of their <|image_pad|> runs; the stored pad count is checked."""
        images = []
        for row, (source, sample) in enumerate(zip(sources.tolist(), samples.tolist())):
            mine = self.sources[source].read(sample)
            self._check(tokens[row], mine, source, sample)
            images += mine
        grid = np.asarray([g for _, g in images], np.int64).reshape(-1, 3)
        rows = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
        pixels = np.empty((int(rows[-1]), self.processing.patch_dim), np.float32)
        for (image, _), lo, hi in zip(images, rows[:-1].tolist(), rows[1:].tolist()):
            self.processing.patches(image, out=pixels[lo:hi])  # straight into its rows
        return torch.from_numpy(pixels), torch.from_numpy(grid)

    def _check(self, tokens: np.ndarray, images: list, source: int, sample: int) -> None:
        if self.pad_id is None:
            return
        want = sum(self.processing.tokens(g) for _, g in images)
        found = int((tokens == self.pad_id).sum())
        if found != want:
            raise DataError(
                f"window {sample} of source {source}: its images take {want} image tokens, its "
                f"tokens hold {found}; the prepared data is damaged: prepare it again"
            )

    def close(self) -> None:
        for s in self.sources:
            s.close()
