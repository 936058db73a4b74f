"""Sharded, reshardable checkpoints over pyarrow.fs: named element ranges, not ranks.

This layer knows nothing of FSDP. On save each rank hands over `TensorChunk`s (a named tensor's
global shape and dtype, and one contiguous flat element range of it); on load any rank asks for
any element range of any named tensor. So N ranks can save and M load, under any sharding.

    writer = CheckpointWriter(root, keep=3)            # root: a path or s3://, gs://, hdfs:// URI
    writer.save(step, rank, world, chunks, state, barrier)
    path = latest_checkpoint(root)                     # newest committed + whole, or None
    reader = CheckpointReader(path); reader.read(key, start, numel)
    python -m trainer.checkpoint inspect|verify|export ...

Layout of one checkpoint, f"{root}/step_{step:09d}/":

    rank-00000-of-00004.bin   raw little-endian bytes of rank 0's chunks, back to back (64-byte
    ...                       aligned), each chunk cut into checksum blocks of <= 4 MiB
    chunks.arrow              the chunk table (Arrow IPC file), one row per chunk: key, shape,
                              dtype, start, numel, rank, file, byte offset, block size, crc32s
    manifest.json             written LAST, atomically: the commit. Format and version, step,
                              world size, trainer `state`, every shard file with its size, and
                              the chunk table's size and crc32; plus a crc32 of itself.

Why this format:
- Raw bytes + dtype/shape in metadata: nothing is unpickled, so loading an untrusted checkpoint
  cannot run code; bf16/fp8 round-trip bit for bit (written through a uint8 view).
- One data file per rank, written sequentially from one host buffer: saving runs at disk speed
  and needs no coordination beyond one barrier. Positional reads of just the overlapping blocks
  (straight into the destination tensor; one HTTP Range GET on S3) make a resharded load cost
  what the new shard needs, not the whole checkpoint.
- Blocks of <= 4 MiB each with a crc32: a corrupt byte is caught in the block that is read, and
  a ranged read over-reads by less than one block at each end of a range.
- The chunk table is Arrow rather than JSON: it has a row per (rank, tensor, state) chunk, which
  reaches ~10^5 rows for large models at large world sizes; Arrow reads that in milliseconds. The
  scalar metadata is JSON, readable with `cat`.
- Commit = manifest last. Object stores make one PUT visible atomically; local filesystems get
  write-tmp + fsync + rename. Each rank fsyncs its shard before the barrier, so the manifest can
  never be durable before the data it commits. Before writing, every rank removes an old
  manifest of the same step (a superseded save); rank 0 commits only after the barrier, only if
  every rank's index is present and matches its data file and every tensor is fully covered.
- Everything goes through pyarrow.fs, so local paths and URIs run the same code.
"""

from trainer.checkpoint.catalog import CheckpointInfo, latest_checkpoint, list_checkpoints
from trainer.checkpoint.format import BLOCK_BYTES, CheckpointError, TensorChunk
from trainer.checkpoint.reader import CheckpointReader
from trainer.checkpoint.verify import verify
from trainer.checkpoint.writer import CheckpointWriter

__all__ = [
    "BLOCK_BYTES",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointReader",
    "CheckpointWriter",
    "TensorChunk",
    "latest_checkpoint",
    "list_checkpoints",
    "verify",
]
