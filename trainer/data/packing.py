"""Packing whole documents into fixed windows, at preparation (DESIGN.md invariant 2).

    bins = best_fit_decreasing([len(d) for d in docs], width)      # documents per window
    windows = build_windows(docs, masks, bins, width, pad_id)      # tokens, mask, positions

Best-fit-decreasing: documents longest first (ties in document order), each into the open
window with the least room that still holds it (ties: the window opened first), else a new
window. It is deterministic, so the same unit always gives the same bytes on any runner, and
it never splits a document. Inside a window the documents keep their document order; the rest
is padding (pad id, mask 0), which is its own document for the positions.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


def best_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Document indices per window (each window's in document order); every length <= width."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: list[tuple[int, int]] = []  # (room left, window), sorted: least room first
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n > width:
            raise ValueError(f"document {i} of {n} tokens does not fit a window of {width}")
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            bins.append([i])
            left, w = width - n, len(bins) - 1
        else:
            left, w = room.pop(k)
            bins[w].append(i)
            left -= n
        bisect.insort(room, (left, w))
    return [sorted(b) for b in bins]


@dataclass
class Windows:
    tokens: np.ndarray
    """[n, width] int64."""
    mask: np.ndarray
    """[n, width] uint8: 1 = a loss target."""
    positions: np.ndarray
    """[n, width] int64: position inside the document, 0 at each start (padding too)."""
    real: int
    """Tokens that are not padding."""

    @property
    def counts(self) -> np.ndarray:
        """Loss tokens per window: the targets the window's inputs predict (mask[1:])."""
        return self.mask[:, 1:].sum(axis=1, dtype=np.uint32)


def build_windows(
    docs: list[np.ndarray], masks: list[np.ndarray], bins: list[list[int]], width: int, pad: int
) -> Windows:
    """The windows of `bins`: documents back to back, then padding to `width`."""
    n = len(bins)
    tokens = np.full((n, width), pad, np.int64)
    mask = np.zeros((n, width), np.uint8)
    positions = np.zeros((n, width), np.int64)
    real = 0
    for w, members in enumerate(bins):
        at = 0
        for i in members:
            k = len(docs[i])
            tokens[w, at : at + k] = docs[i]
            mask[w, at : at + k] = masks[i]
            mask[w, at] = 0  # a document's first token: nothing inside it predicts it
            positions[w, at : at + k] = np.arange(k)
            at += k
        positions[w, at:] = np.arange(width - at)
        real += at
    return Windows(tokens, mask, positions, real)


def efficiency(real: int, slots: int) -> float:
    """Real tokens per window slot (1.0: no padding)."""
    return real / slots if slots else 0.0
