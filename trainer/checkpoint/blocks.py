"""Checked ranged reads: bytes [lo, hi) of one chunk, every block they touch verified.

Blocks that lie wholly inside the range are read with one positional read straight into the
destination (no intermediate copy) and checked there; the at most two edge blocks that stick
out of the range are read whole into a scratch buffer, checked, and their inside part copied.
So a read fetches exactly the overlapping blocks, and every byte it returns was checksummed.

Reading and checksumming overlap: the inside blocks are read in groups of about PIPELINE_BYTES,
and each group is checked on a thread of its own (zlib.crc32 releases the GIL) while the next
group is read, so a load runs at the speed of the slower of the two instead of their sum
(benchmarks.checkpoint: load against a raw read of the same bytes).
"""

from __future__ import annotations

import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import pyarrow.fs as pafs

from trainer.checkpoint.format import CheckpointError, ChunkRow


def read_checked(
    f: pafs.RandomAccessFile,
    row: ChunkRow,
    lo: int,
    hi: int,
    dst: memoryview,
    scratch: bytearray,
    where: str,
) -> int:
    """Fill `dst` (hi - lo bytes) with bytes [lo, hi) of chunk `row`; return bytes fetched.

    `scratch` must hold one block. `where` (the step directory) prefixes error messages.
    """
    if hi <= lo:
        return 0
    bb = row.block_bytes
    first, last = lo // bb, (hi - 1) // bb
    i0 = first if first * bb >= lo else first + 1  # first block wholly inside
    i1 = last + 1 if _end(row, last) <= hi else last  # one past the last wholly inside
    fetched = 0
    if i0 < i1:
        s, e = i0 * bb, _end(row, i1 - 1)
        group = max(1, PIPELINE_BYTES // bb)  # blocks per read
        pending: Optional[Future] = None
        try:
            for g0 in range(i0, i1, group):
                g1 = min(g0 + group, i1)
                a, z = g0 * bb, _end(row, g1 - 1)
                _read_exact(f, row, a, dst[a - lo : z - lo], where)
                if pending is not None:
                    pending.result()  # the previous group's checks (raises on a bad block)
                pending = _checker().submit(_check_blocks, row, g0, g1, dst, lo, where)
        finally:
            if pending is not None:
                pending.result()
        fetched += e - s
    for b in sorted({first, last} - set(range(i0, i1))):
        s, e = b * bb, _end(row, b)
        buf = memoryview(scratch)[: e - s]
        _read_exact(f, row, s, buf, where)
        _check(row, b, buf, where)
        a, z = max(s, lo), min(e, hi)
        dst[a - lo : z - lo] = buf[a - s : z - s]
        fetched += e - s
    return fetched


PIPELINE_BYTES = 8 * 2**20
"""Bytes read per group while the previous group is checksummed."""

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _checker() -> ThreadPoolExecutor:
    """One checksum thread per process (a read checks one group while it reads the next)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crc32")
        return _pool


def _check_blocks(row: ChunkRow, b0: int, b1: int, dst: memoryview, lo: int, where: str) -> None:
    bb = row.block_bytes
    for b in range(b0, b1):
        _check(row, b, dst[b * bb - lo : _end(row, b) - lo], where)


def checksums_in_background(buf, spans: list[tuple[int, int]], block_bytes: int) -> Future:
    """The crc32 of every block of each (offset, nbytes) span of `buf` (a numpy byte array that
    does not change meanwhile), computed on the checksum thread while the caller writes the
    same bytes: a save runs at the speed of the slower of the two. The future's result is one
    list of block checksums per span."""

    def run() -> list[list[int]]:
        return [
            [
                zlib.crc32(memoryview(buf[lo : min(lo + block_bytes, off + n)]))
                for lo in range(off, off + n, block_bytes)
            ]
            for off, n in spans
        ]

    return _checker().submit(run)


def _end(row: ChunkRow, block: int) -> int:
    return min((block + 1) * row.block_bytes, row.nbytes)


def _read_exact(
    f: pafs.RandomAccessFile, row: ChunkRow, at: int, buf: memoryview, where: str
) -> None:
    """Chunk bytes [at, at + len(buf)) into buf: one positional read (an HTTP range on S3)."""
    f.seek(row.offset + at)
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            raise CheckpointError(
                f"{where}/{row.file}: truncated: {row.describe()} needs file "
                f"bytes [{row.offset + at}, {row.offset + at + len(buf)}) but "
                f"the file ends at {row.offset + at + got}"
            )
        got += n


def _check(row: ChunkRow, block: int, data: memoryview, where: str) -> None:
    if zlib.crc32(data) != row.crc32[block]:
        start = row.offset + block * row.block_bytes
        raise CheckpointError(
            f"{where}/{row.file}: checksum mismatch in block {block} (file "
            f"bytes [{start}, {start + len(data)})) of {row.describe()}: "
            "the data is corrupt"
        )
