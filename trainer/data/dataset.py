"""A prepared dataset on disk or object storage: token shards, and the manifest that indexes them.

    data = PreparedData.open("s3://bucket/data/prepared")
    stream = data.stream(source=0, split="train")     # one source's training tokens, in order
    tokens = stream.read(start, 129)                  # a ranged read of just those tokens

Layout of `<prepared_dir>/`:

    manifest.json                        written LAST, atomically: the commit. The digest of the
                                         sources, tokenizer and settings; the tokenizer; the token
                                         dtype; per source and split (train, eval) the shards in
                                         stream order with tokens, documents, bytes and crc32
    <digest12>-s000-u000017-train.bin    raw little-endian token ids (uint16 or uint32) of one
    <digest12>-s000-u000017-eval.bin     work unit's documents, each followed by end-of-document
    <digest12>-s000-u000017.done.json    the unit's record: written after its shards, so a
                                         preparation that died resumes at the first unfinished unit

Chat preparations (layout "windows", data.kind=chat) store fixed windows of W = seq_len + 1
tokens: sample i is tokens [i*W, (i+1)*W). Beside each `<name>.bin`: `<name>.mask.bin` (uint8
per token, 1 = a loss target), `<name>.pos.bin` (uint16, or uint32 when W > 65535: the token's
position inside its document) and `<name>.count.bin` (uint32 per window: its loss tokens), each
with its crc32 in the shard's `files`; a shard whose windows hold images also has the images'
files (window_images.py). Text preparations are layout "stream" (manifests written
before layouts existed read as that): sample i is tokens [i*T, i*T + T + 1).

The token stream of a (source, split) is its shards back to back, in manifest order. The
manifest's cumulative token counts are the global index: global token position p is found in a
shard by binary search, without reading any data, so a worker reads only the byte ranges of the
samples it needs. Shard names carry the digest: files of two preparations never mix.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from trainer import storage
from trainer.storage import Location

FORMAT = "elastic-fsdp-tokens"
VERSION = 2
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
STREAM = {"kind": "stream"}
"""The layout of text preparations: one token stream, windows cut across documents."""
EXTRA_FILES = {"mask": "mask", "positions": "pos", "counts": "count"}
EXTRA_FILES.update(pixels="img", images="imgs", window_images="wimg")  # with images only
"""Files beside a windows shard's tokens: kind -> the suffix of its name."""


class DataError(RuntimeError):
    """A prepared dataset is missing, incomplete or inconsistent; the message says which file."""


def shard_name(digest: str, source: int, unit: int, split: str) -> str:
    return f"{digest[:12]}-s{source:03d}-u{unit:06d}-{split}.bin"


def extra_name(shard: str, kind: str) -> str:
    """`<name>.mask.bin` etc. beside the tokens file `<name>.bin`."""
    return f"{shard.removesuffix('.bin')}.{EXTRA_FILES[kind]}.bin"


def positions_dtype(width: int) -> np.dtype:
    return np.dtype(np.uint16) if width <= 2**16 else np.dtype(np.uint32)


def unit_record_name(digest: str, source: int, unit: int) -> str:
    return f"{digest[:12]}-s{source:03d}-u{unit:06d}.done.json"


@dataclass
class ShardInfo:
    name: str
    tokens: int
    documents: int
    nbytes: int
    crc32: int
    windows: int = 0
    """Layout windows: the windows in the shard (tokens = windows x width)."""
    real_tokens: int = 0
    """Layout windows: tokens that are not padding."""
    files: dict = field(default_factory=dict)
    """Layout windows: kind (mask, positions, counts; pixels, images, window_images with
    images) -> {name, nbytes, crc32}, and n, its elements, where that is not the tokens
    (mask, positions) or the windows (counts)."""

    def extra(self, kind: str) -> "ShardInfo":
        """The file of `kind` beside the tokens, as a ShardInfo of its elements."""
        f = self.files[kind]
        n = f.get("n", self.windows if kind == "counts" else self.tokens)
        return ShardInfo(f["name"], n, self.documents, f["nbytes"], f["crc32"])


@dataclass
class SplitIndex:
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)


@dataclass
class SourceIndex:
    name: str
    """The source as configured (path, glob or URI)."""
    format: str
    text_column: str
    files: int
    input_bytes: int
    splits: dict[str, SplitIndex]
    skipped: dict[str, int]
    """Records skipped, by reason (non_utf8, unreadable, not_text): counted, never silent."""


@dataclass
class Manifest:
    digest: str
    """sha256 of the sources' files, the tokenizer and the settings: the dataset's identity."""
    tokenizer: dict
    """name (byte or the tokenizer.json's path), digest, vocab_size, eod_id."""
    dtype: str
    sources: list[SourceIndex]
    settings: dict
    created: float
    layout: dict = field(default_factory=lambda: dict(STREAM))
    """{"kind": "stream"} (text), or {"kind": "windows", "width": W, "positions_dtype": ...}."""

    def to_json(self) -> bytes:
        body = asdict(self)
        return json.dumps({"format": FORMAT, "version": VERSION, **body}, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise DataError(
                    f"{where}: format {doc.get('format')!r} version {doc.get('version')!r}; "
                    f"this code reads {FORMAT!r} version {VERSION}: prepare the data again "
                    "(python -m cluster.prepare, or any training run does it)"
                )
            sources = [
                SourceIndex(
                    **{
                        **s,
                        "splits": {
                            k: SplitIndex([ShardInfo(**sh) for sh in v["shards"]])
                            for k, v in s["splits"].items()
                        },
                    }
                )
                for s in doc["sources"]
            ]
            return cls(
                doc["digest"],
                doc["tokenizer"],
                doc["dtype"],
                sources,
                doc["settings"],
                doc["created"],
                doc.get("layout", dict(STREAM)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}: not a valid manifest ({type(e).__name__}: {e})") from None


class TokenStream:
    """One (source, split)'s tokens as one array: reads of any rows of it, across its shards.

    Reads are positional, straight into the caller's buffer: `os.preadv` on local disks (one
    system call per window, no copy in between), `read_at` on object stores (one HTTP range
    request per window). A reader's memory is what it reads, never the size of the corpus: a
    memory map would be simpler, but every page it touches (and the kernel's fault-around pages
    beside it) counts in the process's resident set until it is unmapped, so a worker streaming
    a large corpus would appear to hold all of it. Files are opened on first use and kept open
    (at most MAX_OPEN, the least recently used closed first)."""

    MAX_OPEN = 64

    def __init__(self, root: Location, split: SplitIndex, dtype: np.dtype):
        self.root, self.dtype = root, np.dtype(dtype)
        self.shards = [s for s in split.shards if s.tokens]
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards]).astype(np.int64)
        self.bytes_read = 0
        self.local = root.is_local
        self._files: OrderedDict[int, object] = OrderedDict()  # shard -> fd or pyarrow file
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream."""
        return self.read_rows(np.array([start], np.int64), count)[0]

    def read_rows(self, starts: np.ndarray, count: int) -> np.ndarray:
        """Row r: tokens [starts[r], starts[r] + count) of the stream; [len(starts), count]."""
        starts = np.asarray(starts, np.int64)
        n = len(starts)
        if n and (starts.min() < 0 or starts.max() + count > len(self)):
            bad = int(starts[(starts < 0) | (starts + count > len(self))][0])
            raise DataError(f"read [{bad}, {bad + count}) outside the stream's {len(self)} tokens")
        out = np.empty((n, count), self.dtype)
        if not n or not count:
            return out
        shard = np.searchsorted(self.starts, starts, side="right") - 1
        across = np.flatnonzero(starts + count > self.starts[shard + 1])
        for row in across.tolist():  # rare: a window across two shards
            self._read_across(int(starts[row]), out[row])
        rows = (
            np.arange(n)
            if not len(across)
            else np.flatnonzero(starts + count <= self.starts[shard + 1])
        )
        at = ((starts - self.starts[shard]) * self.dtype.itemsize)[rows].tolist()
        files = [self._files.get(i) or self._open(i) for i in shard[rows].tolist()]
        view = memoryview(out).cast("B")
        width = count * self.dtype.itemsize
        if self.local:  # one system call per window, straight into its row
            preadv = os.preadv
            for row, fd, offset in zip(rows.tolist(), files, at):
                if preadv(fd, [view[row * width : (row + 1) * width]], offset) != width:
                    self._truncated(int(shard[row]), offset, width)
        else:
            for row, f, offset in zip(rows.tolist(), files, at):
                data = f.read_at(width, offset)
                if len(data) != width:
                    self._truncated(int(shard[row]), offset, width)
                view[row * width : (row + 1) * width] = data
        self.bytes_read += out.nbytes
        return out

    def _truncated(self, i: int, at: int, nbytes: int):
        size = self.dtype.itemsize
        raise DataError(
            f"{self.root}/{self.shards[i].name}: truncated: tokens [{at // size}, "
            f"{(at + nbytes) // size}) need bytes up to {at + nbytes}, beyond the file's end; "
            "prepare the data again"
        )

    def _read_across(self, start: int, out: np.ndarray) -> None:
        i = int(np.searchsorted(self.starts, start, side="right") - 1)
        pos, done = start, 0
        while done < len(out):
            lo = pos - int(self.starts[i])
            n = min(len(out) - done, self.shards[i].tokens - lo)
            out[done : done + n] = self._piece(i, lo, n)
            done, pos, i = done + n, pos + n, i + 1

    def _piece(self, i: int, lo: int, n: int) -> np.ndarray:
        """Tokens [lo, lo + n) of shard i."""
        size = self.dtype.itemsize
        f = self._files.get(i) or self._open(i)
        if self.local:
            data = os.pread(f, n * size, lo * size)
        else:
            data = f.read_at(n * size, lo * size)
        if len(data) != n * size:
            self._truncated(i, lo * size, n * size)
        return np.frombuffer(data, self.dtype)

    def _open(self, i: int):
        with self._lock:
            f = self._files.get(i)
            if f is None:
                shard = self.shards[i]
                path = self.root.child(shard.name).path
                try:
                    f = (
                        os.open(path, os.O_RDONLY)
                        if self.local
                        else self.root.fs.open_input_file(path)
                    )
                except FileNotFoundError:
                    raise DataError(
                        f"{self.root}/{shard.name}: missing; prepare the data again"
                    ) from None
                while len(self._files) >= self.MAX_OPEN:
                    self._close(self._files.popitem(last=False)[1])
                self._files[i] = f
            return f

    def _close(self, f) -> None:
        if self.local:
            os.close(f)
        else:
            f.close()

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                self._close(f)
            self._files.clear()


def find_dataset(prepared_dir: str, digest: str | None = None) -> str:
    """The folder of one preparation under data.prepared_dir: the one with `digest`, or, without
    a digest, the only one there (or prepared_dir itself when it holds a manifest)."""
    root = storage.resolve(prepared_dir)
    if digest:
        return str(root.child(digest[:16]))
    if storage.exists(root.child(MANIFEST)):
        return prepared_dir
    found = sorted(
        n for n in storage.list_dir(root) if storage.exists(root.child(n).child(MANIFEST))
    )
    if len(found) == 1:
        return str(root.child(found[0]))
    if not found:
        raise DataError(
            f"no prepared data under {prepared_dir!r}; run python -m cluster.prepare with the same "
            "data.* settings, or a training run, which prepares first"
        )
    raise DataError(
        f"{prepared_dir!r} holds {len(found)} preparations ({', '.join(found)}): "
        "say which (the launcher passes its digest; python -m trainer.data inspect "
        f"{prepared_dir} lists them)"
    )


class PreparedData:
    """An opened preparation: its manifest, and a token stream per source and split."""

    def __init__(self, root: Location, manifest: Manifest):
        self.root, self.manifest = root, manifest
        self.dtype = np.dtype(manifest.dtype)

    @classmethod
    def open(cls, prepared_dir: str) -> "PreparedData":
        root = storage.resolve(prepared_dir)
        where = f"{root}/{MANIFEST}"
        try:
            data = storage.read_bytes(root.child(MANIFEST))
        except FileNotFoundError:
            raise DataError(
                f"no prepared data at {prepared_dir!r} ({MANIFEST} missing: never prepared, or "
                "the preparation has not finished); run python -m cluster.prepare with the same "
                "data.* settings, or a training run, which prepares first"
            ) from None
        return cls(root, Manifest.from_json(data, where))

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def vocab_size(self) -> int:
        return int(self.manifest.tokenizer["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.manifest.tokenizer["eod_id"])

    def tokenizer_info(self) -> dict:
        """The tokenizer as the manifest records it: name (byte, or its tokenizer.json),
        digest, vocab_size, eod_id and eod_token; with a tokenizer_config.json or a chat
        template also chat_template, tokenizer_config, bos_token, bos_id, eos_token,
        eot_token and stop_ids (every id that ends a turn, the end-of-turn id first)."""
        return dict(self.manifest.tokenizer)

    @property
    def width(self) -> Optional[int]:
        """Layout windows: the window width W (= data.seq_len + 1); None for a stream."""
        layout = self.manifest.layout
        return int(layout["width"]) if layout.get("kind") == "windows" else None

    def extra_stream(self, kind: str, source: int, split: str = "train") -> TokenStream:
        """Layout windows: the mask or positions of a (source, split), aligned with its tokens."""
        shards = [s.extra(kind) for s in self.manifest.sources[source].splits[split].shards]
        dtype = {"mask": "uint8", "counts": "uint32"}.get(kind)
        dtype = dtype or self.manifest.layout["positions_dtype"]
        return TokenStream(self.root, SplitIndex(shards), np.dtype(dtype))

    def window_counts(self, source: int, split: str = "train") -> np.ndarray:
        """Layout windows: the loss tokens of each window of a (source, split), uint32."""
        stream = self.extra_stream("counts", source, split)
        try:
            return stream.read(0, len(stream)) if len(stream) else np.zeros(0, np.uint32)
        finally:
            stream.close()

    @property
    def num_sources(self) -> int:
        return len(self.manifest.sources)

    def stream(self, source: int, split: str = "train") -> TokenStream:
        return TokenStream(self.root, self.manifest.sources[source].splits[split], self.dtype)

    def tokens(self, split: str = "train") -> int:
        return sum(s.splits[split].tokens for s in self.manifest.sources)

    def documents(self, split: str = "train") -> int:
        return sum(s.splits[split].documents for s in self.manifest.sources)

    def skipped(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.manifest.sources:
            for reason, n in s.skipped.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def verify(self, names: Optional[list[str]] = None) -> list[str]:
        """Problems of the shard files (missing, wrong size, crc32 mismatch), one per file; []
        means every byte is as prepared. Reads every shard (or those in `names`)."""
        problems = []
        listing = storage.list_dir(self.root)
        for source in self.manifest.sources:
            for split in source.splits.values():
                for shard in split.shards:
                    if names is not None and shard.name not in names:
                        continue
                    problems += _verify_shard(self.root, listing, shard)
                    for kind in shard.files:
                        problems += _verify_shard(self.root, listing, shard.extra(kind))
        return problems


def _verify_shard(root: Location, listing: dict, shard: ShardInfo) -> list[str]:
    info = listing.get(shard.name)
    where = f"{root}/{shard.name}"
    if info is None:
        return [f"{where}: missing (the manifest records {shard.nbytes} bytes)"]
    if info.size != shard.nbytes:
        return [f"{where}: {info.size} bytes, the manifest records {shard.nbytes}"]
    crc = 0
    with root.fs.open_input_stream(root.child(shard.name).path, compression=None) as f:
        while chunk := f.read(8 * 2**20):
            crc = zlib.crc32(chunk, crc)
    if crc != shard.crc32:
        return [f"{where}: crc32 {crc:#010x}, the manifest records {shard.crc32:#010x} (corrupt)"]
    return []
