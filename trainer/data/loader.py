"""One rank's batches: the samples of its part of each step, read by byte range, ahead of time.

    batches = Batches(PreparedData.open(dir), seq_len=128, seed=0, global_batch=8)
    loader = Loader(batches, rank, world, micro_batches=1, start=step0, stop=steps, depth=2)
    for mb in loader.next(step): model(mb.to(device, non_blocking=True).inputs) ...

Chat preparations (layout windows) hold fixed windows: sample i is window i, with its loss mask
and positions read beside its tokens; the loss-token count of every window is loaded once at
open (4 bytes a window), so every rank knows a step's global loss-token count without any
communication (`Batches.loss_tokens`, the loss normaliser: DESIGN.md invariant 1). Text with
data.document_mask=true gets positions made from the tokens (restart after end-of-document).
Windows that hold images (a vision-language chat preparation) come with their images' patches
and grids, made from the stored resized images as the model's image processor makes them
(window_images.py).

A worker never holds more than `depth` steps of its own samples: each sample is one positional
read of (seq_len + 1) tokens from the shard that holds it (two reads at a shard boundary), done by
a background thread while the current step computes. Batches are pinned when they go to a GPU, so
the copy to the device does not block the host.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from trainer.config import ConfigError

from .dataset import PreparedData, TokenStream
from .sampler import GlobalOrder, rank_range
from .splits import too_small, window_mismatch
from .window_images import Images

EVAL_TAG = 1
"""Seeds the evaluation set's order apart from training's."""
PARALLEL_READS = 8
"""Ranged reads in flight per worker on object stores."""


@dataclass
class MicroBatch:
    """Sequences of one micro-batch: the windows of seq_len + 1 tokens as stored (2 or 4 bytes a
    token), the int64 inputs and targets made from them where they are used (on the device).

    Moving the stored dtype and converting on the device copies a quarter (uint16) of the bytes
    an int64 batch would, and the host does no conversion at all. The stored unsigned ids travel
    as the signed integer type of the same width (torch's unsigned types support little) and are
    masked back to their value when widened."""

    tokens: torch.Tensor
    """[b, T + 1] int16 or int32: the windows' token ids, as stored (read as unsigned)."""
    weight: float
    """1.0, or 0.0 for a padding micro-batch (run forward/backward, contribute nothing)."""
    sample_ids: np.ndarray
    """The samples in this micro-batch (for a padding one, the one it borrowed)."""
    sources: np.ndarray
    """The source of each sample (data.mix index; 0 with one source)."""
    loss_mask: Optional[torch.Tensor] = None
    """[b, T + 1] uint8 as stored: 1 = this window token is a loss target; None: every token."""
    positions: Optional[torch.Tensor] = None
    """[b, T + 1]: each token's position inside its document (0 starts one), as stored (int16
    or int32, read as unsigned) or int64 once moved; None: one causal sequence per window."""
    pixels: Optional[torch.Tensor] = None
    """float32 [N, 3 x temporal_patch_size x patch_size**2] (1176 for Qwen2-VL): the patches of
    the micro-batch's images, as transformers' pixel_values, in the order of their
    <|image_pad|> runs (row by row, then along the tokens); [0, 1176] when these windows hold
    none; None when the preparation has no images at all."""
    image_grid: Optional[torch.Tensor] = None
    """int64 [n_images, 3]: each image's (t, h, w) in patches, as image_grid_thw; its
    <|image_pad|> run is t * h * w // merge_size**2 tokens long. None with pixels."""

    @property
    def input_positions(self) -> Optional[torch.Tensor]:
        """LongTensor [b, T] (the inputs' positions), or None."""
        if self.positions is None:
            return None
        return _widen(self.positions)[:, :-1]

    @property
    def loss_weights(self) -> Optional[torch.Tensor]:
        """float32 [b, T]: mask[:, 1:] x weight (0 everywhere in a padding micro-batch), or
        None when there is no mask (every target counts, times weight)."""
        if self.loss_mask is None:
            return None
        return self.loss_mask[:, 1:].to(torch.float32) * self.weight

    @property
    def windows(self) -> torch.Tensor:
        """[b, T + 1] int64 token ids."""
        return _widen(self.tokens)

    @property
    def inputs(self) -> torch.Tensor:
        """LongTensor [b, T]."""
        return self.windows[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        """LongTensor [b, T]: inputs shifted by one token."""
        return self.windows[:, 1:]

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        """On `device`, widened to int64 there (one conversion for inputs and targets)."""

        def move(t, widen=True):
            if t is None:
                return None
            t = t.to(device, non_blocking=non_blocking)
            return _widen(t) if widen else t

        return dataclasses.replace(
            self,
            tokens=move(self.tokens),
            loss_mask=move(self.loss_mask, widen=False),
            positions=move(self.positions),
            pixels=move(self.pixels, widen=False),
            image_grid=move(self.image_grid, widen=False),
        )

    def pin(self) -> "MicroBatch":
        def pin(t):
            return None if t is None else t.pin_memory()

        return dataclasses.replace(
            self,
            tokens=pin(self.tokens),
            loss_mask=pin(self.loss_mask),
            positions=pin(self.positions),
            pixels=pin(self.pixels),
            image_grid=pin(self.image_grid),
        )


def _widen(t: torch.Tensor) -> torch.Tensor:
    """int64 of a stored unsigned tensor (travelling as the signed type of its width)."""
    if t.dtype == torch.int64:
        return t
    return t.long() & _MASKS[t.dtype]


def document_positions(windows: np.ndarray, eod_id: int) -> np.ndarray:
    """[n, W] int64 positions of text windows: 0 at the window's start and after each
    end-of-document token, counting up inside each document."""
    n, width = windows.shape
    index = np.broadcast_to(np.arange(width, dtype=np.int64), (n, width))
    starts = np.zeros((n, width), bool)
    starts[:, 0] = True
    starts[:, 1:] = windows[:, :-1] == eod_id
    last = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - last


_MASKS = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}
_SIGNED = {
    np.dtype(np.uint16): np.int16,
    np.dtype(np.uint32): np.int32,
    np.dtype(np.uint8): np.uint8,
}


class Batches:
    """Which samples make each step, and their tokens: a pure function of the step."""

    def __init__(
        self,
        data: PreparedData,
        seq_len: int,
        seed: int,
        global_batch: int,
        weights: Optional[list[float]] = None,
        split: str = "train",
        tag: int = 0,
        document_mask: bool = False,
    ):
        if global_batch <= 0:
            raise ConfigError(
                f"invalid config: train.global_batch_size={global_batch}; valid: a positive integer"
            )
        self.data, self.seq_len, self.global_batch = data, seq_len, global_batch
        self.width = data.width
        """Layout windows: W (sample i = tokens [i*W, (i+1)*W)); None: a stream."""
        self.document_mask = document_mask and self.width is None
        self.streams: list[TokenStream] = [data.stream(i, split) for i in range(data.num_sources)]
        sources = range(data.num_sources)
        if self.width is not None:
            if seq_len + 1 != self.width:
                raise ConfigError(window_mismatch(data, seq_len))
            self.mask_streams = [data.extra_stream("mask", i, split) for i in sources]
            self.position_streams = [data.extra_stream("positions", i, split) for i in sources]
            self.counts = [data.window_counts(i, split).astype(np.int64) for i in sources]
            self.num_samples = [len(s) // self.width for s in self.streams]
            self.images = Images.open(data, split)
        else:
            self.num_samples = [(len(s) - 1) // seq_len for s in self.streams]
            self.images = None
        for i, n in enumerate(self.num_samples):
            if n <= 0:  # the driver's preflight says the same before any worker starts
                raise ConfigError(too_small(data, i, split, seq_len))
        weights = weights or [1.0] * len(self.streams)
        self.order = GlobalOrder(self.num_samples, weights, seed, tag)
        remote = not data.root.is_local
        self._pool = ThreadPoolExecutor(PARALLEL_READS, "data-read") if remote else None

    def positions(self, step: int, rank: int = 0, world: int = 1) -> np.ndarray:
        lo, hi = rank_range(self.global_batch, world, rank)
        start = step * self.global_batch
        return np.arange(start + lo, start + hi, dtype=np.int64)

    def step_ids(self, step: int, rank: int = 0, world: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(sources, sample ids) of this rank's part of `step`."""
        return self.order.lookup(self.positions(step, rank, world))

    def tokens(self, sources: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """[n, T + 1]: each sample's window, in the stored dtype. On object stores the reads (one
        HTTP range request each) run in parallel; on a local disk one after another."""
        return self._read(self.streams, sources, samples)

    def _read(self, streams: list[TokenStream], sources, samples) -> np.ndarray:
        """[n, T + 1] rows of `streams` (tokens, or the mask or positions beside them)."""
        width = self.seq_len + 1
        stride = self.width or self.seq_len
        if len(streams) == 1 and self._pool is None:
            return streams[0].read_rows(samples * stride, width)
        raw = np.empty((len(samples), width), streams[0].dtype)
        for src in np.unique(sources):
            rows = np.flatnonzero(sources == src)
            starts = samples[rows] * stride
            stream = streams[int(src)]
            if self._pool is None:
                part = stream.read_rows(starts, width)
            else:
                pieces = np.array_split(np.arange(len(rows)), min(len(rows), PARALLEL_READS))
                parts = self._pool.map(lambda p: stream.read_rows(starts[p], width), pieces)
                part = np.concatenate(list(parts))
            raw[rows] = part
        return raw

    def micro_batches(self, step: int, rank: int, world: int, n_micro: int) -> list[MicroBatch]:
        """Exactly n_micro micro-batches for every rank (collectives run per micro-batch, so all
        ranks must run the same number of forwards). The rank's samples are split with
        np.array_split; an empty split becomes one padding sample (the step's first sample)
        with weight 0.0, which runs forward and backward but adds nothing to loss or gradient."""
        if n_micro <= 0:
            raise ConfigError(
                f"invalid config: train.micro_batches={n_micro}; valid: a positive integer"
            )
        sources, ids = self.step_ids(step, rank, world)
        if n_micro == 1 and len(ids):  # the usual case
            return [self._micro(sources, ids, 1.0)]
        first = None
        out = []
        for part in np.array_split(np.arange(len(ids)), n_micro):
            weight = 1.0
            src, sid = sources[part], ids[part]
            if len(part) == 0:
                if first is None:
                    first = self.order.lookup(np.array([step * self.global_batch]))
                (src, sid), weight = first, 0.0
            out.append(self._micro(src, sid, weight))
        return out

    def fixed_micro_batches(self, count: int, rank: int, world: int, rows: int) -> list[MicroBatch]:
        """The first `count` positions, this rank's part in micro-batches of at most `rows`
        sequences; every rank gets the same number of micro-batches (padding weight 0)."""
        lo, hi = rank_range(count, world, rank)
        sources, ids = self.order.lookup(np.arange(lo, hi))
        n_micro = max(1, -(-(count // world + (1 if count % world else 0)) // rows))
        out = []
        for part in np.array_split(np.arange(len(ids)), n_micro):
            if len(part) == 0:
                src, sid = self.order.lookup(np.array([0]))
                out.append(self._micro(src, sid, 0.0))
            else:
                out.append(self._micro(sources[part], ids[part], 1.0))
        return out

    def loss_tokens(self, step: int) -> int:
        """The loss tokens of the whole global batch of `step` (every rank computes the same
        number): text global_batch x seq_len, windows the sum of their loss-token counts."""
        if self.width is None:
            return self.global_batch * self.seq_len
        start = step * self.global_batch
        sources, ids = self.order.lookup(np.arange(start, start + self.global_batch))
        return int(sum(self.counts[int(s)][ids[sources == s]].sum() for s in np.unique(sources)))

    def _micro(self, sources: np.ndarray, ids: np.ndarray, weight: float) -> MicroBatch:
        raw = self.tokens(sources, ids)
        mask = positions = None
        if self.width is not None:
            mask = torch.from_numpy(self._read(self.mask_streams, sources, ids))
            positions = _tensor(self._read(self.position_streams, sources, ids))
        elif self.document_mask:
            positions = torch.from_numpy(document_positions(raw, self.data.eod_id))
        pixels = grid = None
        if self.images is not None:
            pixels, grid = self.images.patches(sources, ids, raw)
        return MicroBatch(_tensor(raw), weight, ids, sources, mask, positions, pixels, grid)

    def epochs(self, step: int) -> list[float]:
        return self.order.epochs(step * self.global_batch)


def _tensor(raw: np.ndarray) -> torch.Tensor:
    """A stored unsigned array as the signed tensor of its width (no copy)."""
    return torch.from_numpy(raw.view(_SIGNED[raw.dtype]))


class Loader:
    """Micro-batches of steps [start, stop) for one rank, read `depth` steps ahead in a thread."""

    def __init__(
        self,
        batches: Batches,
        rank: int,
        world: int,
        micro_batches: int,
        start: int,
        stop: int,
        depth: int = 2,
        pin: bool = False,
    ):
        self.batches, self.rank, self.world = batches, rank, world
        self.micro_batches, self.pin = micro_batches, pin
        self.next_step = start
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(start, stop), daemon=True, name=f"data-loader-rank{rank}"
        )
        self._thread.start()

    def _produce(self, start: int, stop: int) -> None:
        for step in range(start, stop):
            try:
                item = self.batches.micro_batches(step, self.rank, self.world, self.micro_batches)
                if self.pin:
                    item = [mb.pin() for mb in item]
            except BaseException as e:  # handed to the training thread, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put((step, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def next(self, step: int) -> list[MicroBatch]:
        """The micro-batches of `step`, which must be the step after the previous call's."""
        if step != self.next_step:
            raise RuntimeError(f"loader: step {step} asked, step {self.next_step} is next")
        got, item = self._queue.get()
        assert got == step, (got, step)
        if isinstance(item, BaseException):
            raise item
        self.next_step += 1
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
