"""One rank's batches: the samples of its part of each step, read by byte range, ahead of time.

    batches = Batches(PreparedData.open(dir), seq_len=128, seed=0, global_batch=8)
    loader = Loader(batches, rank, world, micro_batches=1, start=step0, stop=steps, depth=2)
    for mb in loader.next(step): model(mb.to(device, non_blocking=True).inputs) ...

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

    @property
    def windows(self) -> torch.Tensor:
        """[b, T + 1] int64 token ids."""
        if self.tokens.dtype == torch.int64:
            return self.tokens
        return self.tokens.long() & _MASKS[self.tokens.dtype]

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
        moved = self.tokens.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, tokens=dataclasses.replace(self, tokens=moved).windows)

    def pin(self) -> "MicroBatch":
        return dataclasses.replace(self, tokens=self.tokens.pin_memory())


_MASKS = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}
_SIGNED = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32}


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
    ):
        if global_batch <= 0:
            raise ConfigError(
                f"invalid config: train.global_batch_size={global_batch}; valid: a positive integer"
            )
        self.data, self.seq_len, self.global_batch = data, seq_len, global_batch
        self.streams: list[TokenStream] = [data.stream(i, split) for i in range(data.num_sources)]
        self.num_samples = [(len(s) - 1) // seq_len for s in self.streams]
        for i, n in enumerate(self.num_samples):
            if n <= 0:
                tokens = len(self.streams[i])
                raise ConfigError(
                    f"invalid config: data.seq_len={seq_len}; valid: at most {max(tokens - 1, 0)} "
                    f"(the {split} split of source {i} ({data.manifest.sources[i].name}) holds "
                    f"{tokens} tokens; add data, or raise data.max_bytes / lower "
                    "data.eval_fraction)"
                )
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
        width = self.seq_len + 1
        if len(self.streams) == 1 and self._pool is None:
            return self.streams[0].read_rows(samples * self.seq_len, width)
        raw = np.empty((len(samples), width), self.data.dtype)
        for src in np.unique(sources):
            rows = np.flatnonzero(sources == src)
            starts = samples[rows] * self.seq_len
            stream = self.streams[int(src)]
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

    def _micro(self, sources: np.ndarray, ids: np.ndarray, weight: float) -> MicroBatch:
        raw = self.tokens(sources, ids)
        return MicroBatch(torch.from_numpy(raw.view(_SIGNED[raw.dtype])), weight, ids, sources)

    def epochs(self, step: int) -> list[float]:
        return self.order.epochs(step * self.global_batch)


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
