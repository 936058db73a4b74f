"""`verify`: read every block of every chunk of a checkpoint and report all problems."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import pyarrow.fs as pafs

from trainer import storage
from trainer.checkpoint.blocks import read_checked
from trainer.checkpoint.catalog import file_problems, load_rows, read_manifest
from trainer.checkpoint.commit import coverage_problems
from trainer.checkpoint.format import CheckpointError, ChunkRow
from trainer.storage import Location

WINDOW_BLOCKS = 16
"""Blocks checked per read: bounds verify's memory to 16 blocks whatever the chunk size."""


def verify(path: str, filesystem: Optional[pafs.FileSystem] = None) -> list[str]:
    """Every problem of the checkpoint at `path` (all checksums read); [] means it is sound."""
    loc = storage.resolve(path, filesystem)
    try:
        listing = storage.list_dir(loc)
        body = read_manifest(loc, listing)
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
    for name, file_rows in sorted(by_file.items()):
        problems += _verify_file(loc, name, sorted(file_rows, key=lambda r: r.offset))
    return problems


def _rows_if_table_ok(loc: Location, body: dict, problems: list[str]) -> list[ChunkRow]:
    """With some shard files bad, still check the others, if the chunk table itself is fine."""
    if any(p.startswith(f"{loc}/{body['chunk_table']['name']}:") for p in problems):
        return []
    return load_rows(loc, body)


def _verify_file(loc: Location, name: str, rows: list[ChunkRow]) -> list[str]:
    """Check every block of `rows` (all in file `name`), one window of blocks at a time."""
    problems = []
    with loc.fs.open_input_file(loc.child(name).path) as f:
        for row in rows:
            window = WINDOW_BLOCKS * row.block_bytes
            buf = bytearray(min(window, row.nbytes))
            for lo in range(0, row.nbytes, window):
                hi = min(lo + window, row.nbytes)
                try:  # window edges are block edges: everything is read straight into buf
                    read_checked(f, row, lo, hi, memoryview(buf)[: hi - lo], bytearray(0), str(loc))
                except CheckpointError as e:
                    problems.append(str(e))
                    if "truncated" in str(e):
                        break
    return problems
