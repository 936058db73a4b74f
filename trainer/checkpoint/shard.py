"""One rank's part of a save: check the chunks, copy them off the device, write the shard file.

The copy (`stage`) is the only part the training loop waits for. It packs every chunk into one
reusable host buffer (pinned when any chunk is on CUDA), laid out exactly as the shard file will
be, so the background write is a sequential pass over that buffer computing block checksums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from trainer import storage
from trainer.checkpoint.blocks import checksums_in_background
from trainer.checkpoint.format import (
    ALIGN,
    MANIFEST,
    CheckpointError,
    TensorChunk,
    data_file_name,
    dtype_name,
    index_file_name,
    itemsize,
    numel_of,
    rows_to_table,
    table_to_bytes,
)
from trainer.storage import Location


@dataclass(frozen=True)
class Placement:
    """Where one chunk's bytes sit in the staging buffer and, identically, in the shard file."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    numel: int
    offset: int
    nbytes: int


def validate_chunks(chunks: list[TensorChunk]) -> None:
    """Reject what could not be read back correctly, naming the chunk and what is valid."""
    seen: dict[str, tuple] = {}
    for i, c in enumerate(chunks):
        if not isinstance(c, TensorChunk):
            raise CheckpointError(f"chunks[{i}] is a {type(c).__name__}; valid: TensorChunk")
        if not isinstance(c.key, str) or not c.key:
            raise CheckpointError(f"chunks[{i}].key={c.key!r}; valid: a non-empty string")
        dtype_name(c.dtype, c.key)
        shape = tuple(c.shape)
        if any(not isinstance(s, int) or s < 0 for s in shape):
            raise CheckpointError(f"chunk {c.key!r}: shape={c.shape!r}; valid: non-negative ints")
        if not isinstance(c.data, torch.Tensor) or c.data.dim() != 1:
            raise CheckpointError(
                f"chunk {c.key!r}: data must be a 1-D tensor, got "
                f"{getattr(c.data, 'shape', type(c.data).__name__)}"
            )
        if c.data.dtype != c.dtype:
            raise CheckpointError(
                f"chunk {c.key!r}: data dtype {c.data.dtype} != declared {c.dtype}"
            )
        if c.start < 0 or c.start + c.numel > numel_of(shape):
            raise CheckpointError(
                f"chunk {c.key!r}: elements [{c.start}, {c.start + c.numel}) "
                f"outside the tensor of shape {shape} ({numel_of(shape)} elements)"
            )
        if seen.setdefault(c.key, (shape, c.dtype)) != (shape, c.dtype):
            raise CheckpointError(
                f"chunk {c.key!r}: shape/dtype {(shape, c.dtype)} differs from "
                f"another chunk of the same tensor {seen[c.key]}"
            )


def plan(chunks: list[TensorChunk]) -> tuple[list[Placement], int]:
    """Placements in file order (chunks aligned to ALIGN bytes) and the total file size."""
    out, pos = [], 0
    for c in chunks:
        pos = -(-pos // ALIGN) * ALIGN
        nbytes = c.numel * itemsize(c.dtype)
        out.append(Placement(c.key, tuple(c.shape), c.dtype, c.start, c.numel, pos, nbytes))
        pos += nbytes
    return out, pos


def stage(
    chunks: list[TensorChunk],
    placements: list[Placement],
    total: int,
    staging: Optional[torch.Tensor],
) -> torch.Tensor:
    """Copy every chunk into the staging buffer (reused when big enough) and return the buffer.

    After this returns the caller may modify its tensors: the save no longer reads them.
    """
    cuda = any(c.data.is_cuda for c in chunks)
    if staging is None or staging.numel() < total or staging.is_pinned() != cuda:
        staging = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=cuda)
    for c, p in zip(chunks, placements):
        dst = staging[p.offset : p.offset + p.nbytes].view(p.dtype)
        dst.copy_(c.data.detach(), non_blocking=cuda)
    if cuda:  # the non-blocking device-to-host copies must land before we return
        for dev in {c.data.device for c in chunks if c.data.is_cuda}:
            torch.cuda.synchronize(dev)
    return staging


def nonfinite_chunks(staging: torch.Tensor, placements: list[Placement]) -> list[str]:
    """Keys of the floating-point chunks in `staging` (a host copy) holding a NaN or an
    infinity: min/max reductions over each (no temporary the size of a chunk)."""
    bad = []
    for p in placements:
        if not p.numel or not p.dtype.is_floating_point:
            continue
        view = staging[p.offset : p.offset + p.nbytes].view(p.dtype)
        try:
            lo, hi = torch.aminmax(view)
        except RuntimeError:  # a dtype without CPU min/max (float8): through float32
            lo, hi = torch.aminmax(view.float())
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            bad.append(p.key)
    return bad


def write_shard(
    step_dir: Location,
    step: int,
    rank: int,
    world_size: int,
    placements: list[Placement],
    total: int,
    staging: torch.Tensor,
    block_bytes: int,
) -> None:
    """Write this rank's data file (block checksums computed on the way), then its index.

    The index is written last, so its presence means the data file is complete; rank 0's commit
    relies on that. A stale index of this rank from an earlier try at this step is removed first.
    """
    step_dir.fs.create_dir(step_dir.path, recursive=True)
    # A previous (torn or superseded) save of this step must not stay committed while we
    # overwrite its files: every rank removes the old manifest before writing any data, and the
    # new one is written only after all ranks passed the barrier.
    storage.delete_file(step_dir.child(MANIFEST))
    index = step_dir.child(index_file_name(rank, world_size))
    storage.delete_file(index)
    data = step_dir.child(data_file_name(rank, world_size))
    buf = staging.numpy()
    rows = []
    # Checksums on their own thread while the same bytes are written (blocks.py).
    crcs_of = checksums_in_background(buf, [(p.offset, p.nbytes) for p in placements], block_bytes)
    with data.fs.open_output_stream(data.path, compression=None) as f:
        pos = 0
        for p in placements:
            f.write(b"\0" * (p.offset - pos))
            for lo in range(p.offset, p.offset + p.nbytes, block_bytes):
                f.write(memoryview(buf[lo : min(lo + block_bytes, p.offset + p.nbytes)]))
            pos = p.offset + p.nbytes
        crcs_per_placement = crcs_of.result()
        for p, crcs in zip(placements, crcs_per_placement):
            rows.append(
                dict(
                    key=p.key,
                    shape=list(p.shape),
                    dtype=dtype_name(p.dtype),
                    start=p.start,
                    numel=p.numel,
                    rank=rank,
                    file=data.name,
                    offset=p.offset,
                    block_bytes=block_bytes,
                    crc32=crcs,
                )
            )
    storage.fsync(data)
    meta = dict(step=step, rank=rank, world_size=world_size, data_file=data.name, data_size=total)
    storage.write_atomic(index, table_to_bytes(rows_to_table(rows), meta))
