"""The on-disk format: names, the chunk-table schema, dtype codes and the self-checked manifest.

Everything here is pure data encoding (no I/O), so the writer, the reader, `verify` and the CLI
agree on one definition. See the package docstring for the layout and why it was chosen.
"""

from __future__ import annotations

import json
import math
import re
import sys
import zlib
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import torch

FORMAT = "elastic-fsdp-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CHUNK_TABLE = "chunks.arrow"
BLOCK_BYTES = 4 * 2**20
"""Default checksum block: small enough that a ranged read over-reads at most 4 MiB per chunk
end, large enough that the per-block table entries stay negligible (8B model: ~30k blocks)."""
MAX_BLOCK_BYTES = 2**30
"""The largest checksum block a reader accepts beyond its chunk's own size: a block buffer is
never larger than the chunk (whose bytes the shard file really holds) or this."""
ALIGN = 64
"""Chunks start on 64-byte boundaries in a shard file, so any dtype can be viewed in place."""

_STEP_DIR = re.compile(r"^step_(\d{9,})$")

if sys.byteorder != "little":  # raw bytes are little-endian by definition of the format
    raise ImportError(
        "trainer.checkpoint stores raw little-endian tensors; big-endian hosts are not supported"
    )


class CheckpointError(RuntimeError):
    """A checkpoint is missing, uncommitted, corrupt, or cannot be written; says which and why."""


@dataclass
class TensorChunk:
    """One contiguous 1-D element range of a named tensor, as one rank holds it."""

    key: str
    """Tensor name, e.g. 'model/layers.0.attention.wq.weight' or 'optim/<param>/exp_avg'."""
    shape: tuple[int, ...]
    """Global (full) shape of the tensor."""
    dtype: torch.dtype
    """Element dtype; `data.dtype` must equal it."""
    start: int
    """Flat (row-major) offset of the first element of this chunk in the full tensor."""
    data: torch.Tensor
    """1-D tensor of this chunk's elements, on any device."""

    @property
    def numel(self) -> int:
        return int(self.data.numel())


# ----------------------------------------------------------------------------- names


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step of a 'step_000000042' directory name, None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def data_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.bin"


def index_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.index.arrow"


# ----------------------------------------------------------------------------- dtypes

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(
            f"tensor {key!r}: dtype {dtype} cannot be stored; valid: {', '.join(_DTYPES)}"
        )
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str, key: str = "?") -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(
            f"tensor {key!r}: unknown dtype {name!r} in the chunk table; "
            f"valid: {', '.join(_DTYPES)}"
        )
    return _DTYPES[name]


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def numel_of(shape) -> int:
    return math.prod(int(s) for s in shape)


# ----------------------------------------------------------------------------- chunk table

CHUNK_SCHEMA = pa.schema(
    [
        ("key", pa.string()),  # tensor name
        ("shape", pa.list_(pa.int64())),  # global shape
        ("dtype", pa.string()),  # torch dtype name, e.g. 'bfloat16'
        ("start", pa.int64()),  # first element of the chunk in the flat full tensor
        ("numel", pa.int64()),  # elements in the chunk
        ("rank", pa.int32()),  # rank that wrote it
        ("file", pa.string()),  # shard file name inside the step directory
        ("offset", pa.int64()),  # byte offset of the chunk in that file
        ("block_bytes", pa.int64()),  # checksum block size (last block may be shorter)
        ("crc32", pa.list_(pa.uint32())),  # zlib.crc32 of each block
    ]
)


@dataclass(frozen=True)
class ChunkRow:
    """One row of the chunk table, as the reader and `verify` use it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    numel: int
    rank: int
    file: str
    offset: int
    block_bytes: int
    crc32: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def block_size(self) -> int:
        """The largest block actually stored: block_bytes, or the whole chunk if smaller."""
        return min(self.block_bytes, self.nbytes)

    def describe(self) -> str:
        return f"chunk {self.key}[{self.start}:{self.end}] (rank {self.rank}, {self.file})"


def rows_to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=CHUNK_SCHEMA)


def table_to_rows(table: pa.Table) -> list[ChunkRow]:
    """Decode and sanity-check every row; a row that does not add up raises CheckpointError."""
    if not table.schema.equals(CHUNK_SCHEMA, check_metadata=False):
        raise CheckpointError(f"chunk table has schema {table.schema}, expected {CHUNK_SCHEMA}")
    rows = []
    for i, r in enumerate(table.to_pylist()):
        nulls = [k for k, v in r.items() if v is None or (isinstance(v, list) and None in v)]
        if nulls:
            raise CheckpointError(f"chunk table row {i}: null in {', '.join(nulls)}; valid: values")
        row = ChunkRow(
            key=r["key"],
            shape=tuple(r["shape"]),
            dtype=dtype_from_name(r["dtype"], r["key"]),
            start=r["start"],
            numel=r["numel"],
            rank=r["rank"],
            file=r["file"],
            offset=r["offset"],
            block_bytes=r["block_bytes"],
            crc32=tuple(r["crc32"]),
        )
        _check_row(row)
        rows.append(row)
    return rows


def _check_row(row: ChunkRow) -> None:
    if any(s < 0 for s in row.shape):
        raise CheckpointError(f"{row.describe()}: shape {row.shape}; valid: sizes >= 0")
    total = numel_of(row.shape)
    if row.start < 0 or row.numel < 0 or row.end > total:
        raise CheckpointError(f"{row.describe()}: range outside the tensor of shape {row.shape}")
    if row.offset < 0:
        raise CheckpointError(f"{row.describe()}: offset={row.offset}; valid: >= 0")
    # The writer records its block size for every chunk, so a small chunk may carry a block
    # larger than itself; readers size buffers by row.block_size, never by block_bytes alone.
    if (
        row.block_bytes <= 0
        or row.block_bytes % itemsize(row.dtype)
        or row.block_bytes > max(MAX_BLOCK_BYTES, row.nbytes)
    ):
        raise CheckpointError(
            f"{row.describe()}: block_bytes={row.block_bytes}; valid: a positive multiple of "
            f"{itemsize(row.dtype)} (the {dtype_name(row.dtype)} itemsize), at most "
            f"max({MAX_BLOCK_BYTES}, the chunk's {row.nbytes} bytes)"
        )
    blocks = -(-row.nbytes // row.block_bytes)
    if blocks != len(row.crc32):
        raise CheckpointError(
            f"{row.describe()}: {len(row.crc32)} block checksums for "
            f"{row.nbytes} bytes in blocks of {row.block_bytes}; valid: {blocks}"
        )


def table_to_bytes(table: pa.Table, metadata: Optional[dict] = None) -> bytes:
    """Arrow IPC file bytes; `metadata` (JSON-able) goes into the schema metadata."""
    if metadata is not None:
        table = table.replace_schema_metadata({b"elastic_fsdp": json.dumps(metadata).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def table_from_bytes(data: bytes, what: str) -> tuple[pa.Table, dict]:
    try:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise CheckpointError(f"{what}: not a readable Arrow IPC file ({e})") from e
    raw = (table.schema.metadata or {}).get(b"elastic_fsdp")
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError as e:
        raise CheckpointError(f"{what}: unreadable metadata ({e})") from e
    return table, meta


# ----------------------------------------------------------------------------- manifest


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(body: dict) -> bytes:
    """JSON with a crc32 of its own canonical form, so a flipped byte cannot change the state or
    the file list silently (it either breaks the JSON or the checksum)."""
    doc = {"manifest": body, "crc32": zlib.crc32(_canonical(body))}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def decode_manifest(data: bytes, where: str) -> dict:
    try:
        doc = json.loads(data)
        body, crc = doc["manifest"], doc["crc32"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{where}: manifest is not valid JSON of this format ({e})") from e
    if zlib.crc32(_canonical(body)) != crc:
        raise CheckpointError(
            f"{where}: manifest checksum mismatch (the file was modified or "
            "corrupted after it was written)"
        )
    if not isinstance(body, dict):
        raise CheckpointError(
            f"{where}: manifest body is a JSON {type(body).__name__}; valid: a JSON object"
        )
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{where}: format {body.get('format')!r}, expected {FORMAT!r}")
    if body.get("version") != VERSION:
        raise CheckpointError(
            f"{where}: format version {body.get('version')!r}; this code reads version {VERSION}"
        )
    return body
