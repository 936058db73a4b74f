"""Checked ranged reads: bytes [lo, hi) of one chunk, every block they touch verified.

Blocks that lie wholly inside the range are read with one positional read straight into the
destination (no intermediate copy) and checked there; the at most two edge blocks that stick
out of the range are read whole into a scratch buffer, checked, and their inside part copied.
So a read fetches exactly the overlapping blocks, and every byte it returns was checksummed.
"""

from __future__ import annotations

import zlib

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
        inner = dst[s - lo : e - lo]
        _read_exact(f, row, s, inner, where)
        for b in range(i0, i1):
            _check(row, b, inner[b * bb - s : _end(row, b) - s], where)
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
