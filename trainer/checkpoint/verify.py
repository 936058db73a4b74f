"""`verify`: read every block of every chunk of a checkpoint and report all problems.

With check_finite (the CLI's default), floating tensors holding NaN or Inf are problems too: a
checkpoint of a run that diverged is whole, but nothing can be trained or served from it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Optional

import pyarrow.fs as pafs
import torch

from trainer import storage
from trainer.checkpoint.blocks import read_checked
from trainer.checkpoint.catalog import file_problems, load_rows, read_manifest, refuse_malformed
from trainer.checkpoint.commit import coverage_problems
from trainer.checkpoint.format import CheckpointError, ChunkRow, dtype_name
from trainer.storage import Location

WINDOW_BLOCKS = 16
"""Blocks checked per read: bounds verify's memory to 16 blocks whatever the chunk size."""


def verify(
    path: str, filesystem: Optional[pafs.FileSystem] = None, check_finite: bool = False
) -> list[str]:
    """Every problem of the checkpoint at `path` (all checksums read); [] means it is sound.
    `check_finite`: also report each floating tensor holding NaN/Inf, with the count."""
    loc = storage.resolve(path, filesystem)
    try:
        listing = storage.list_dir(loc)
        body = read_manifest(loc, listing)
        with refuse_malformed(str(loc)):
            problems = file_problems(loc, body, listing)
        rows = load_rows(loc, body) if not problems else _rows_if_table_ok(loc, body, problems)
    except (CheckpointError, OSError) as e:
        return [str(e)]
    problems += coverage_problems(rows)
    bad_files = {p.split(": ", 1)[0] for p in problems}
    by_file: dict[str, list[ChunkRow]] = defaultdict(list)
    for r in rows:
        if f"{loc}/{r.file}" not in bad_files:
            by_file[r.file].append(r)
    nonfinite: Counter[str] = Counter()
    for name, file_rows in sorted(by_file.items()):
        rows_by_offset = sorted(file_rows, key=lambda r: r.offset)
        problems += _verify_file(loc, name, rows_by_offset, nonfinite if check_finite else None)
    dtypes = {r.key: r.dtype for r in rows}
    for key, n in sorted((k, n) for k, n in nonfinite.items() if n):
        problems.append(
            f"{loc}: tensor {key!r} ({dtype_name(dtypes[key])}): {n} non-finite value(s) (NaN/Inf)"
        )
    return problems


def _rows_if_table_ok(loc: Location, body: dict, problems: list[str]) -> list[ChunkRow]:
    """With some shard files bad, still check the others, if the chunk table itself is fine."""
    if any(p.startswith(f"{loc}/{body['chunk_table']['name']}:") for p in problems):
        return []
    return load_rows(loc, body)


def _verify_file(
    loc: Location, name: str, rows: list[ChunkRow], nonfinite: Optional[Counter]
) -> list[str]:
    """Check every block of `rows` (all in file `name`), one window of blocks at a time; count
    NaN/Inf per key of floating chunks into `nonfinite` (None: don't look)."""
    problems = []
    with loc.fs.open_input_file(loc.child(name).path) as f:
        for row in rows:
            window = WINDOW_BLOCKS * row.block_size
            buf = bytearray(min(window, row.nbytes))
            for lo in range(0, row.nbytes, window):
                hi = min(lo + window, row.nbytes)
                data = memoryview(buf)[: hi - lo]
                try:  # window edges are block edges: everything is read straight into buf
                    read_checked(f, row, lo, hi, data, bytearray(0), str(loc))
                except CheckpointError as e:
                    problems.append(str(e))
                    if "truncated" in str(e):
                        break
                    continue
                if nonfinite is not None and row.dtype.is_floating_point:
                    nonfinite[row.key] += _count_nonfinite(data, row)
    return problems


def _count_nonfinite(data: memoryview, row: ChunkRow) -> int:
    """NaN/Inf among the elements in `data`, one block at a time (bounded extra memory)."""
    n = 0
    for a in range(0, len(data), row.block_size):
        t = torch.frombuffer(data[a : a + row.block_size], dtype=row.dtype)
        if t.element_size() == 1:  # float8: no isfinite kernel; float16 holds every value
            t = t.to(torch.float16)
        n += int(torch.isfinite(t).logical_not_().sum())
    return n
