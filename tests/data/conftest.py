"""Small corpora built by the tests themselves (JSONL, Parquet with a text column, text files), a
BPE tokenizer trained on them, and token datasets made straight from arrays."""

from __future__ import annotations

import json
import random
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data import train_tokenizer
from trainer.data.dataset import MANIFEST, Manifest, ShardInfo, SourceIndex, SplitIndex

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega the of and to in is it that was for"
).split()


def documents(n: int, seed: int = 0, words: tuple[int, int] = (20, 120)) -> list[str]:
    """n documents of sentences from a fixed word list; some non-ASCII, lengths vary."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        out.append(f"Document {i}: {body}. Ünïcode ✓ {i % 7}.")
    return out


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str], column: str = "text", row_group: int = 50) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), column: docs})
    pq.write_table(table, path, row_group_size=row_group)
    return path


@pytest.fixture(scope="session")
def parquet_corpus(tmp_path_factory) -> Path:
    """Three Parquet files of 120 documents each, a text column and an id column."""
    root = tmp_path_factory.mktemp("parquet_corpus")
    for k in range(3):
        write_parquet(root / f"part-{k}.parquet", documents(120, seed=k))
    return root


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory, parquet_corpus) -> Path:
    """A byte-level BPE tokenizer.json (vocab 512) trained here on the corpus' documents."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    docs = [d for k in range(3) for d in documents(120, seed=k)]
    path.write_text(train_tokenizer(docs, 512).to_str())
    return path


def make_dataset(
    root: Path,
    streams: list[np.ndarray],
    shard_tokens: int = 64,
    vocab_size: int = 256,
    eval_streams: list[np.ndarray] | None = None,
) -> str:
    """A prepared dataset holding exactly these token streams (one per source), cut into shards of
    `shard_tokens`: for tests of the reader and the order without tokenizing anything."""
    root.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    sources = []
    for i, stream in enumerate(streams):
        splits = {}
        for split, data in (
            ("train", stream),
            ("eval", (eval_streams or [None] * len(streams))[i]),
        ):
            shards = []
            if data is not None:
                for k, start in enumerate(range(0, len(data), shard_tokens)):
                    part = np.asarray(data[start : start + shard_tokens], dtype).tobytes()
                    name = f"test-s{i:03d}-u{k:06d}-{split}.bin"
                    (root / name).write_bytes(part)
                    shards.append(
                        ShardInfo(name, len(part) // dtype.itemsize, 1, len(part), zlib.crc32(part))
                    )
            splits[split] = SplitIndex(shards)
        sources.append(SourceIndex(f"source{i}", "text", "text", 1, 0, splits, {}))
    manifest = Manifest(
        "0" * 64,
        {"name": "byte", "digest": "byte", "vocab_size": vocab_size, "eod_id": 0},
        dtype.name,
        sources,
        {},
        time.time(),
    )
    (root / MANIFEST).write_bytes(manifest.to_json())
    return str(root)


class Helpers:
    documents = staticmethod(documents)
    write_jsonl = staticmethod(write_jsonl)
    write_parquet = staticmethod(write_parquet)
    make_dataset = staticmethod(make_dataset)


@pytest.fixture
def dh() -> type[Helpers]:
    """The helpers above (test modules never import conftest: with several conftest.py files in
    the tree that import is ambiguous)."""
    return Helpers
