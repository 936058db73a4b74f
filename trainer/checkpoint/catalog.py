"""Which checkpoints exist and which are committed and whole: cheap checks, no checksum pass.

"Committed and whole" means: manifest.json present, its own checksum and format version good,
every field of it of the right type and within bounds (schema.py), every shard file it lists
present with the recorded size, and the chunk table's checksum and rows good.
That costs one LIST of the step directory and two small reads, so resume can afford it for every
candidate. Corruption inside a shard is caught when those bytes are read (or by `verify`).
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import pyarrow.fs as pafs

from trainer import storage
from trainer.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    ChunkRow,
    decode_manifest,
    parse_step_dir,
    table_from_bytes,
    table_to_rows,
)
from trainer.checkpoint.schema import check_manifest, check_rows
from trainer.storage import Location


@contextmanager
def refuse_malformed(where: str):
    """A safety net under the schema: anything a malformed manifest or chunk table still trips
    over becomes the reason its checkpoint is skipped, never a crash of resume or the CLI."""
    try:
        yield
    except (KeyError, TypeError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        raise CheckpointError(f"{where}: malformed ({type(e).__name__}: {e})") from e


def read_manifest(step_dir: Location, listing: Optional[dict] = None) -> dict:
    """The manifest body, or CheckpointError saying why the directory is not a committed
    checkpoint."""
    listing = storage.list_dir(step_dir) if listing is None else listing
    if not listing:
        raise CheckpointError(f"{step_dir}: no such checkpoint directory (or it is empty)")
    if MANIFEST not in listing:
        raise CheckpointError(
            f"{step_dir}: not committed: no {MANIFEST} (the save was torn "
            "before rank 0 committed it, or is still in progress)"
        )
    where = f"{step_dir}/{MANIFEST}"
    data = storage.read_bytes(step_dir.child(MANIFEST))
    with refuse_malformed(where):
        body = decode_manifest(data, where)
        check_manifest(body, where, parse_step_dir(step_dir.name))
    return body


def file_problems(step_dir: Location, body: dict, listing: dict) -> list[str]:
    """Shard files (and the chunk table) missing or not of the size the manifest recorded."""
    problems = []
    for f in body["files"] + [body["chunk_table"]]:
        info = listing.get(f["name"])
        where = f"{step_dir}/{f['name']}"
        if info is None or info.type != pafs.FileType.File:
            problems.append(f"{where}: missing (the manifest records {f['size']} bytes)")
        elif info.size != f["size"]:
            why = "truncated" if info.size < f["size"] else "longer than written"
            problems.append(f"{where}: {info.size} bytes, the manifest records {f['size']} ({why})")
    return problems


def open_checkpoint(step_dir: Location) -> dict:
    """read_manifest + file checks; raises CheckpointError listing every problem."""
    listing = storage.list_dir(step_dir)
    body = read_manifest(step_dir, listing)
    problems = file_problems(step_dir, body, listing)
    if problems:
        raise CheckpointError(f"{step_dir}: incomplete: " + "; ".join(problems))
    return body


def load_rows(step_dir: Location, body: dict) -> list[ChunkRow]:
    """The chunk table, checked against its manifest checksum, and each row against the shard
    files (schema.check_rows). `body` is a manifest read_manifest returned."""
    meta = body["chunk_table"]
    where = f"{step_dir}/{meta['name']}"
    data = storage.read_bytes(step_dir.child(meta["name"]))
    if zlib.crc32(data) != meta["crc32"]:
        raise CheckpointError(f"{where}: checksum mismatch (chunk table corrupt)")
    with refuse_malformed(where):
        table, _ = table_from_bytes(data, where)
        try:
            rows = table_to_rows(table)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from e
        check_rows(rows, body, where)
    return rows


def validate(step_dir: Location) -> dict:
    """Everything resume checks before trusting a checkpoint (see the module docstring)."""
    body = open_checkpoint(step_dir)
    load_rows(step_dir, body)
    return body


@dataclass
class CheckpointInfo:
    step: int
    path: str
    problem: Optional[str]
    """None when committed and whole; else why not."""


def step_dirs(
    root: str, filesystem: Optional[pafs.FileSystem] = None
) -> list[tuple[int, Location]]:
    """Every step_* directory under `root`, newest first (one LIST, nothing validated)."""
    base = storage.resolve(root, filesystem)
    found = [
        (parse_step_dir(name), base.child(name))
        for name, info in storage.list_dir(base).items()
        if info.type == pafs.FileType.Directory and parse_step_dir(name) is not None
    ]
    return sorted(found, key=lambda s: -s[0])


def check(step_dir: Location) -> Optional[str]:
    """None when `step_dir` is committed and whole, else why not."""
    try:
        validate(step_dir)
        return None
    except (CheckpointError, OSError) as e:
        return str(e)


def list_checkpoints(
    root: str, filesystem: Optional[pafs.FileSystem] = None
) -> list[CheckpointInfo]:
    """Every step_* directory under `root`, newest first, each validated (cheap checks)."""
    return [CheckpointInfo(step, str(loc), check(loc)) for step, loc in step_dirs(root, filesystem)]


def latest_checkpoint(
    root: str, log: Callable[[str], None] = print, filesystem: Optional[pafs.FileSystem] = None
) -> Optional[str]:
    """The newest committed and whole checkpoint under `root`, or None.

    Each newer one that is torn or corrupt is skipped with a message saying which and why, and
    the fallback is announced, so a resume never silently goes back in time.
    """
    skipped = []
    for step, loc in step_dirs(root, filesystem):
        problem = check(loc)
        if problem is None:
            if skipped:
                log(
                    f"checkpoint: falling back to {loc} (step {step}); skipped newer "
                    f"step(s) {', '.join(map(str, skipped))}"
                )
            return str(loc)
        log(f"checkpoint: skipping {loc}: {problem}")
        skipped.append(step)
    return None
