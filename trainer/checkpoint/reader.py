"""CheckpointReader: element ranges of named tensors, from whichever ranks wrote them.

    reader = CheckpointReader(path)                 # raises CheckpointError unless committed+whole
    part = reader.read("model/layers.0.attention.wq.weight", start, numel)   # 1-D, CPU

A read touches only the checksum blocks that overlap the range (ranged reads through
pyarrow.fs), verifies each block, and stitches the range together from as many chunks as it
spans, so a checkpoint written by N ranks loads at any M, under any sharding.
"""

from __future__ import annotations

import bisect
import difflib
from collections import defaultdict
from typing import Optional

import pyarrow.fs as pafs
import torch

from trainer import storage
from trainer.checkpoint.blocks import read_checked
from trainer.checkpoint.catalog import load_rows, open_checkpoint
from trainer.checkpoint.format import CheckpointError, ChunkRow, itemsize, numel_of
from trainer.storage import Location


class CheckpointReader:
    def __init__(self, path: str, filesystem: Optional[pafs.FileSystem] = None):
        self.location: Location = storage.resolve(path, filesystem)
        self.manifest = open_checkpoint(self.location)
        self.step: int = self.manifest["step"]
        self.state: dict = self.manifest["state"]
        self.world_size: int = self.manifest["world_size"]
        by_key: dict[str, list[ChunkRow]] = defaultdict(list)
        for row in load_rows(self.location, self.manifest):
            by_key[row.key].append(row)
        # Longest chunk first among equal starts: fewer pieces when ranks overlap (replicas).
        self._chunks = {k: sorted(v, key=lambda r: (r.start, -r.numel)) for k, v in by_key.items()}
        self._starts = {k: [r.start for r in v] for k, v in self._chunks.items()}
        self._files: dict[str, pafs.RandomAccessFile] = {}
        self._scratch_buf = bytearray(0)
        self.bytes_read = 0
        """Shard bytes fetched so far (tests use it to prove reads are ranged)."""

    # ------------------------------------------------------------------ metadata

    def keys(self) -> list[str]:
        return sorted(self._chunks)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._rows(key)[0].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._rows(key)[0].dtype

    def numel(self, key: str) -> int:
        return numel_of(self.shape(key))

    # ------------------------------------------------------------------ data

    def read(self, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start+numel) of the flattened full tensor `key`, as a CPU 1-D tensor."""
        if numel < 0:
            raise CheckpointError(f"read {key!r}: numel={numel}; valid: >= 0")
        return self.read_into(key, start, torch.empty(numel, dtype=self.dtype(key)))

    def read_into(self, key: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Like read(), into `out` (1-D, contiguous, the key's dtype; e.g. a rank's flat shard
        slice), saving a copy and an allocation. A non-CPU `out` is filled through the host."""
        rows, total, numel = self._rows(key), self.numel(key), out.numel()
        if out.dtype != self.dtype(key) or out.dim() != 1 or not out.is_contiguous():
            raise CheckpointError(
                f"read_into {key!r}: out must be a contiguous 1-D "
                f"{self.dtype(key)} tensor, got {out.dtype} {tuple(out.shape)}"
            )
        if start < 0 or start + numel > total:
            raise CheckpointError(
                f"read {key!r}[{start}:{start + numel}]: outside the tensor's "
                f"{total} elements (shape {self.shape(key)})"
            )
        host = out if out.device.type == "cpu" else torch.empty(numel, dtype=out.dtype)
        dst = memoryview(host.view(torch.uint8).numpy())
        isz, end, pos = itemsize(out.dtype), start + numel, start
        # Chunks are sorted by start; only those starting before `end` can overlap.
        for row in rows[: bisect.bisect_left(self._starts[key], end)]:
            if pos == end or row.start > pos:
                break
            if row.end <= pos:
                continue
            upto = min(row.end, end)
            self.bytes_read += read_checked(
                self._open(row),
                row,
                (pos - row.start) * isz,
                (upto - row.start) * isz,
                dst[(pos - start) * isz : (upto - start) * isz],
                self._scratch(row),
                str(self.location),
            )
            pos = upto
        if pos < end:
            raise CheckpointError(
                f"read {key!r}[{start}:{end}]: elements from {pos} on are in no "
                f"chunk of {self.location} (coverage gap)"
            )
        if host is not out:
            out.copy_(host)
        return out

    def read_full(self, key: str) -> torch.Tensor:
        return self.read(key, 0, self.numel(key)).view(self.shape(key))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _rows(self, key: str) -> list[ChunkRow]:
        if key not in self._chunks:
            near = difflib.get_close_matches(key, self._chunks, n=3)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise CheckpointError(
                f"{self.location}: no tensor {key!r} ({len(self._chunks)} tensors stored){hint}"
            )
        return self._chunks[key]

    def _scratch(self, row: ChunkRow) -> bytearray:
        """One reusable block-sized buffer for the edge blocks of ranged reads: the largest block
        stored (row.block_size), which the shard file really holds, never block_bytes alone."""
        if len(self._scratch_buf) < row.block_size:
            self._scratch_buf = bytearray(row.block_size)
        return self._scratch_buf

    def _open(self, row: ChunkRow) -> pafs.RandomAccessFile:
        if row.file not in self._files:
            loc = self.location.child(row.file)
            try:
                self._files[row.file] = loc.fs.open_input_file(loc.path)
            except (FileNotFoundError, OSError) as e:
                raise CheckpointError(
                    f"{loc}: cannot open shard file needed for {row.describe()}: {e}"
                ) from e
        return self._files[row.file]
