"""The global sample order: a pure function of (seed, epoch, position), the same at any world size.

    order = GlobalOrder(num_samples=[n0, n1], weights=[0.7, 0.3], seed=0)
    sources, samples = order.lookup(np.arange(s * B, (s + 1) * B))   # step s's global batch
    lo, hi = rank_range(B, world, rank)                               # this rank's part of it

Sample i of a source is tokens [i*T, i*T + T + 1) of its token stream (T = data.seq_len). Step s
consumes global positions [s*B, (s+1)*B); rank r of W takes a contiguous sub-range. The union over
ranks of a step's samples does not depend on W, and a checkpoint only needs the step to resume
exactly across any sequence of resizes (DESIGN.md invariant 2).

Epochs: the k-th draw from a source of n samples is sample perm_e(k mod n) with e = k // n, where
perm_e is a keyed pseudorandom permutation of range(n) evaluated pointwise (rounds of keyed
bijections on the next power of two, with cycle walking): any position's sample costs a few
integer operations, with no table in memory, so the order stays cheap at billions of samples.

Mixing (data.mix): positions come in blocks of MIX_BLOCK; in each block source i gets exactly its
share of the block (largest-remainder rounding of weight_i x MIX_BLOCK), in a seeded random order.
So every source is drawn at its weight over any window of a few thousand samples, and a source's
k-th draw sits at a position computable without scanning from the start.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIX_BLOCK = 4096
_ROUNDS = 4


def rank_range(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the step's global_batch samples that `rank` takes: a balanced split where the
    first global_batch % world ranks take one more."""
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}; valid: 0 <= rank < world={world}")
    base, extra = divmod(global_batch, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def global_tokens_per_step(global_batch: int, seq_len: int) -> int:
    """Target tokens in one optimizer step, over all ranks: the loss normaliser."""
    return global_batch * seq_len


class Permutation:
    """A keyed pseudorandom permutation of range(n), evaluated pointwise.

    Rounds of bijections on k-bit integers (xor with a key, multiply by an odd number modulo 2^k,
    xor with itself shifted right) permute [0, 2^k) with 2^k < 2n; values that land at n or
    above are walked through the rounds again until they fall inside (cycle walking), which
    keeps it a bijection of range(n) and costs two passes on average."""

    def __init__(self, n: int, key: list[int]):
        if n <= 0:
            raise ValueError(f"Permutation of n={n}; valid: n >= 1")
        self.n = n
        bits = max(1, (n - 1).bit_length())
        self.mask = np.uint64((1 << bits) - 1)
        state = np.random.SeedSequence(key).generate_state(2 * _ROUNDS, dtype=np.uint64)
        self.xors = state[:_ROUNDS] & self.mask
        self.mults = (state[_ROUNDS:] | np.uint64(1)) & self.mask  # odd: invertible mod 2^bits
        self.shifts = [np.uint64(max(1, bits * k // (_ROUNDS + 1))) for k in range(1, _ROUNDS + 1)]

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        mask = self.mask
        with np.errstate(over="ignore"):
            for xor, mult, shift in zip(self.xors, self.mults, self.shifts):
                x = ((x ^ xor) * mult) & mask
                x ^= x >> shift
        return x

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._rounds(np.asarray(positions, dtype=np.uint64))
        n = np.uint64(self.n)
        outside = np.flatnonzero(x >= n)
        while outside.size:  # cycle walking: the domain is under 2n, so two passes on average
            x[outside] = self._rounds(x[outside])
            outside = outside[x[outside] >= n]
        return x.astype(np.int64)


class SourceOrder:
    """The k-th draw from one source: epoch k // n, sample perm_epoch(k % n).

    Positions are consumed in order, so the permutation is evaluated CHUNK positions at a time
    (one vectorised call) and the last few chunks are kept: a step's lookup is an index."""

    CHUNK = 1 << 16
    KEEP = 4

    def __init__(self, num_samples: int, seed: int, source: int, tag: int = 0):
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples}; valid: a positive integer")
        self.n, self.seed, self.source, self.tag = num_samples, seed, source, tag
        self._chunks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _chunk(self, epoch: int, c: int) -> np.ndarray:
        key = (epoch, c)
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            perm = Permutation(self.n, [self.seed, self.tag, self.source, epoch])
            chunk = perm(np.arange(c * self.CHUNK, min((c + 1) * self.CHUNK, self.n)))
        self._chunks[key] = chunk
        while len(self._chunks) > self.KEEP:
            self._chunks.popitem(last=False)
        return chunk

    def samples(self, draws: np.ndarray) -> np.ndarray:
        draws = np.asarray(draws, dtype=np.int64)
        epochs, offsets = np.divmod(draws, self.n)
        chunks, within = np.divmod(offsets, self.CHUNK)
        first = (int(epochs[0]), int(chunks[0])) if len(draws) else None
        if first is not None and (epochs == first[0]).all() and (chunks == first[1]).all():
            return self._chunk(*first)[within]  # the usual case: one step, one chunk
        out = np.empty_like(draws)
        keys = epochs * (self.n // self.CHUNK + 1) + chunks
        for key in np.unique(keys):
            sel = keys == key
            e, c = int(epochs[sel][0]), int(chunks[sel][0])
            out[sel] = self._chunk(e, c)[within[sel]]
        return out


class GlobalOrder:
    """Global position -> (source, sample id), for one or several weighted sources."""

    def __init__(self, num_samples: list[int], weights: list[float], seed: int, tag: int = 0):
        if len(num_samples) != len(weights) or not num_samples:
            raise ValueError(f"{len(num_samples)} sources but {len(weights)} weights")
        self.sources = [SourceOrder(n, seed, i, tag) for i, n in enumerate(num_samples)]
        self.seed, self.tag = seed, tag
        self.counts = _shares(weights, MIX_BLOCK)
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source label, draw within the block's share of that source) for each offset."""
        cached = self._blocks.pop(b, None)
        if cached is None:
            labels = np.repeat(np.arange(len(self.counts)), self.counts)
            labels = labels[
                Permutation(MIX_BLOCK, [self.seed, self.tag, 1 << 20, b])(np.arange(MIX_BLOCK))
            ]
            rank_in_label = np.empty(MIX_BLOCK, np.int64)
            for i in range(len(self.counts)):
                sel = labels == i
                rank_in_label[sel] = np.arange(int(sel.sum()))
            cached = (labels, rank_in_label)
        self._blocks[b] = cached
        while len(self._blocks) > 8:
            self._blocks.popitem(last=False)
        return cached

    def lookup(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id within that source) of each global position."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(self.sources) == 1:
            return np.zeros_like(positions), self.sources[0].samples(positions)
        src = np.empty_like(positions)
        draw = np.empty_like(positions)
        blocks = positions // MIX_BLOCK
        for b in np.unique(blocks):
            sel = blocks == b
            labels, ranks = self._block(int(b))
            offsets = positions[sel] % MIX_BLOCK
            src[sel] = labels[offsets]
            draw[sel] = int(b) * np.asarray(self.counts)[labels[offsets]] + ranks[offsets]
        samples = np.empty_like(positions)
        for i, order in enumerate(self.sources):
            sel = src == i
            if sel.any():
                samples[sel] = order.samples(draw[sel])
        return src, samples

    def epochs(self, positions_done: int) -> list[float]:
        """Epochs of each source consumed by the first `positions_done` positions."""
        total = sum(self.counts)
        return [positions_done * c / total / s.n for c, s in zip(self.counts, self.sources)]


def _shares(weights: list[float], block: int) -> list[int]:
    """Largest-remainder rounding of the normalised weights to `block` positions; every source
    with a positive weight gets at least one."""
    w = np.asarray(weights, dtype=np.float64)
    if (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError(f"weights {weights}; valid: positive numbers")
    exact = w / w.sum() * block
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    while counts.sum() < block:
        counts[np.argmax(exact - counts)] += 1
    while counts.sum() > block:
        counts[np.argmax(counts - exact)] -= 1
    return counts.tolist()
