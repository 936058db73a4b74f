"""Rank 0, after the barrier: merge the ranks' indexes, check them, write the manifest last.

The manifest is the commit. It is written only when every rank's index is present and agrees
with its data file, and when every tensor is covered element for element by some chunk, so a
committed checkpoint can always be loaded whole. Anything else raises and nothing is committed.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.fs as pafs

from trainer import storage
from trainer.checkpoint.format import (
    CHUNK_TABLE,
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ChunkRow,
    encode_manifest,
    index_file_name,
    numel_of,
    table_from_bytes,
    table_to_bytes,
    table_to_rows,
)
from trainer.storage import Location


def commit(step_dir: Location, step: int, world_size: int, state: dict) -> dict:
    """Write chunks.arrow and then manifest.json; return the manifest body."""
    listing = storage.list_dir(step_dir)
    indexes = _parallel(
        lambda rank: _read_index(step_dir, step, rank, world_size, listing), range(world_size)
    )
    files = [
        dict(name=meta["data_file"], size=meta["data_size"], rank=rank)
        for rank, (_, meta) in enumerate(indexes)
    ]
    table = pa.concat_tables([t for t, _ in indexes])
    problems = coverage_problems(table_to_rows(table))
    if problems:
        raise CheckpointError(f"not committing {step_dir}: " + "; ".join(problems))
    table_bytes = table_to_bytes(table)
    storage.write_bytes(step_dir.child(CHUNK_TABLE), table_bytes)
    body = dict(
        format=FORMAT,
        version=VERSION,
        step=step,
        world_size=world_size,
        created_unix=time.time(),
        state=state,
        files=files,
        chunk_table=dict(
            name=CHUNK_TABLE,
            size=len(table_bytes),
            crc32=zlib.crc32(table_bytes),
            rows=table.num_rows,
        ),
    )
    storage.write_atomic(step_dir.child(MANIFEST), encode_manifest(body))
    storage.fsync(step_dir, directory=True)  # the step directory's own entry in the root
    _remove_unreferenced(step_dir, {f["name"] for f in files} | {CHUNK_TABLE, MANIFEST})
    return body


def _read_index(
    step_dir: Location, step: int, rank: int, world_size: int, listing: dict
) -> tuple[pa.Table, dict]:
    name = index_file_name(rank, world_size)
    if name not in listing:
        raise CheckpointError(
            f"not committing {step_dir}: rank {rank} of {world_size} wrote no "
            f"index {name} (its write failed, or it did not save step {step})"
        )
    table, meta = table_from_bytes(storage.read_bytes(step_dir.child(name)), f"{step_dir}/{name}")
    if (meta.get("step"), meta.get("world_size")) != (step, world_size):
        raise CheckpointError(
            f"not committing {step_dir}: {name} is from step {meta.get('step')} "
            f"at world size {meta.get('world_size')}, expected {step}/{world_size}"
        )
    data = listing.get(meta["data_file"])
    if data is None or data.size != meta["data_size"]:
        got = "missing" if data is None else f"{data.size} bytes"
        raise CheckpointError(
            f"not committing {step_dir}: {meta['data_file']} is {got}, its index "
            f"says {meta['data_size']} bytes"
        )
    return table, meta


def coverage_problems(rows: list[ChunkRow]) -> list[str]:
    """Tensors whose chunks disagree on shape/dtype or leave elements uncovered."""
    by_key: dict[str, list[ChunkRow]] = defaultdict(list)
    for r in rows:
        by_key[r.key].append(r)
    problems = []
    for key, chunks in sorted(by_key.items()):
        kinds = {(c.shape, c.dtype) for c in chunks}
        if len(kinds) > 1:
            problems.append(
                f"tensor {key!r}: chunks disagree on shape/dtype {sorted(map(str, kinds))}"
            )
            continue
        total, covered, gaps = numel_of(chunks[0].shape), 0, []
        for c in sorted(chunks, key=lambda c: c.start):
            if c.start > covered:
                gaps.append((covered, c.start))
            covered = max(covered, c.end)
        if covered < total:
            gaps.append((covered, total))
        if gaps:
            missing = sum(b - a for a, b in gaps)
            problems.append(
                f"tensor {key!r}: {missing} of {total} elements are in no chunk "
                f"(first gap [{gaps[0][0]}, {gaps[0][1]}))"
            )
    return problems


def _remove_unreferenced(step_dir: Location, keep: set[str]) -> None:
    """Drop per-rank indexes (merged into chunks.arrow) and files of an earlier, torn save of
    this step at another world size."""
    extra = [
        name
        for name, info in storage.list_dir(step_dir).items()
        if name not in keep and info.type == pafs.FileType.File
    ]
    _parallel(lambda name: storage.delete_file(step_dir.child(name)), extra)


def _parallel(fn, items) -> list:
    """Map over small per-rank files concurrently: on object stores each is a round trip, and
    rank 0 of a 1000-rank job should not pay them one after another."""
    items = list(items)
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(16, len(items))) as ex:
        return list(ex.map(fn, items))
