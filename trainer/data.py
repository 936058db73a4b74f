"""Byte-level token data: text files -> Parquet shards (once), and a world-size-invariant order.

Tokens are bytes (vocabulary 256, nothing to download). The driver calls `resolve_source` and
`prepare` before any worker starts; workers only `load_tokens` and build a `Batcher`.

Order is global, not per rank (DESIGN.md invariant 2): sample i is tokens[i*T : i*T + T + 1];
epoch e visits samples in a permutation that is a pure function of (seed, e); step s consumes
global positions [s*B, (s+1)*B) of that stream and rank r of W takes a contiguous sub-range. So
the union over ranks of a step's samples does not depend on W, and a checkpoint only needs the
step to resume exactly, across any sequence of resizes.

    python -c "from trainer.data import *; from trainer.config import DataConfig; \
               print(prepare(DataConfig(max_bytes=2**20, prepared_dir='/tmp/tok')))"
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
import uuid
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from trainer.config import ConfigError, DataConfig

SEPARATOR = 0
"""Byte written after every document (file); NUL does not occur in text."""
SHARD_TOKENS = 16 * 2**20
"""Tokens per Parquet shard file."""
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_SNIFF_BYTES = 8192
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# ----------------------------------------------------------------------------- sources


def resolve_source(source: str) -> list[str]:
    """The files `data.source` names, in a deterministic order.

    'stdlib': every .py file of this interpreter's standard library (site-packages excluded, so
    the corpus does not depend on what is installed). A file path: that file. A folder: every
    text-like file below it (no NUL byte in its first 8 KiB). Hidden files and folders,
    __pycache__ and site-packages are skipped everywhere.
    Paths are sorted by their path relative to the root. Raises ConfigError naming data.source.
    """
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return _walk(root, lambda path: path.endswith(".py"))
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = _walk(path, _is_text)
        if files:
            return files
        raise ConfigError(
            f"invalid config: data.source={source!r} (a folder with no text files); "
            "valid: 'stdlib', or a text file or a folder holding text files"
        )
    raise ConfigError(
        f"invalid config: data.source={source!r} (no such file or folder); "
        "valid: 'stdlib', or a path to an existing text file or folder"
    )


def _walk(root: str, keep) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not name.startswith(".") and os.path.isfile(path) and keep(path):
                found.append(path)
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def _is_text(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(_SNIFF_BYTES)
    except OSError:
        return False


# ----------------------------------------------------------------------------- prepare


@dataclass
class PreparedInfo:
    """What `prepare` produced (or found). `uri` is absolute: pass it to workers, whose working
    directory may differ from the driver's."""

    uri: str
    num_tokens: int
    num_files: int
    shards: list[str]
    created: bool
    """True if this call wrote the shards; False if a matching manifest was already there."""


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a pyarrow.fs URI, or the local filesystem for a plain path."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def _absolute(uri: str) -> str:
    return uri if "://" in uri else _filesystem(uri)[1]


def prepare(cfg: DataConfig, shard_tokens: int = SHARD_TOKENS) -> PreparedInfo:
    """Write the token shards of `cfg.source` to `cfg.prepared_dir` once; later calls return.

    A JSON manifest records the source, a digest of the file list (paths, sizes, mtimes),
    max_bytes, the shard names and the token count. If the manifest on disk matches and its
    shards exist, nothing is written. Every file (shards, then the manifest that commits them)
    is written under a unique temporary name and moved into place, so concurrent preparers and
    readers never see half a file. Shard names carry a digest of the inputs, so re-preparing
    with other inputs never overwrites shards an older manifest points at (old shards stay).
    """
    files = resolve_source(cfg.source)
    key = _key(cfg, files, shard_tokens)
    fs, root = _filesystem(cfg.prepared_dir)
    uri = _absolute(cfg.prepared_dir)
    found = _read_manifest(fs, root)
    if found and found["key"] == key and _shards_exist(fs, root, found["shards"]):
        return PreparedInfo(uri, found["num_tokens"], len(files), found["shards"], False)
    fs.create_dir(root, recursive=True)
    shards, sizes = _write_shards(fs, root, files, cfg.max_bytes, shard_tokens, key)
    manifest = dict(
        version=FORMAT_VERSION,
        key=key,
        source=cfg.source,
        files_digest=_digest(files),
        num_files=len(files),
        max_bytes=cfg.max_bytes,
        shard_tokens=shard_tokens,
        shards=shards,
        shard_sizes=sizes,
        num_tokens=sum(sizes),
    )
    _atomic_write(fs, f"{root}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return PreparedInfo(uri, manifest["num_tokens"], len(files), shards, True)


def _digest(files: list[str]) -> str:
    """Paths, sizes and mtimes: an edited file changes it without reading every byte."""
    h = hashlib.sha256()
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _key(cfg: DataConfig, files: list[str], shard_tokens: int) -> str:
    parts = [FORMAT_VERSION, cfg.source, _digest(files), cfg.max_bytes, shard_tokens, SEPARATOR]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _read_manifest(fs: pafs.FileSystem, root: str) -> Optional[dict]:
    try:
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
    except (FileNotFoundError, OSError, ValueError):
        return None  # absent or unreadable: prepare (again)
    return manifest if manifest.get("version") == FORMAT_VERSION else None


def _shards_exist(fs: pafs.FileSystem, root: str, shards: list[str]) -> bool:
    infos = fs.get_file_info([f"{root}/{name}" for name in shards])
    return all(info.type == pafs.FileType.File for info in infos)


def _documents(files: list[str], max_bytes: int):
    """Each file's bytes followed by SEPARATOR, the whole stream cut at max_bytes (0 = no cap)."""
    left = max_bytes or None
    for path in files:
        with open(path, "rb") as f:
            doc = f.read() + bytes([SEPARATOR])
        if left is not None:
            doc = doc[:left]
            left -= len(doc)
        yield doc
        if left == 0:
            return


def _write_shards(fs, root, files, max_bytes, shard_tokens, key) -> tuple[list[str], list[int]]:
    shards, sizes, buf = [], [], bytearray()

    def flush(data: bytes) -> None:
        name = f"tokens-{key[:12]}-{len(shards):05d}.parquet"
        table = pa.table({"tokens": pa.array(np.frombuffer(data, dtype=np.uint8))})
        tmp = f"{root}/.tmp-{uuid.uuid4().hex}-{name}"
        pq.write_table(table, tmp, filesystem=fs, compression="zstd")
        fs.move(tmp, f"{root}/{name}")
        shards.append(name)
        sizes.append(len(data))

    for doc in _documents(files, max_bytes):
        buf += doc
        while len(buf) >= shard_tokens:
            flush(bytes(buf[:shard_tokens]))
            del buf[:shard_tokens]
    if buf or not shards:
        flush(bytes(buf))
    return shards, sizes


def _atomic_write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{name}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def load_tokens(prepared_dir: str) -> np.ndarray:
    """All tokens of a prepared corpus, in order, as one uint8 array held in memory.

    Fine for corpora up to a few GB (one byte per token, every rank holds a copy); a larger
    corpus would need per-shard memory mapping. Raises FileNotFoundError if `prepare` has not
    committed a manifest there, ValueError if the shards disagree with it.
    """
    fs, root = _filesystem(prepared_dir)
    manifest = _read_manifest(fs, root)
    if manifest is None:
        raise FileNotFoundError(
            f"no prepared token data at {prepared_dir!r} ({MANIFEST} missing "
            "or unreadable); run trainer.data.prepare first (the entry point "
            "does, on the driver)"
        )
    parts = [
        pq.read_table(f"{root}/{name}", filesystem=fs, columns=["tokens"])
        .column("tokens")
        .to_numpy()
        for name in manifest["shards"]
    ]
    tokens = np.concatenate(parts).astype(np.uint8, copy=False) if parts else np.zeros(0, np.uint8)
    if len(tokens) != manifest["num_tokens"]:
        raise ValueError(
            f"prepared data at {prepared_dir!r} holds {len(tokens)} tokens, its "
            f"manifest says {manifest['num_tokens']}; delete it and prepare again"
        )
    return tokens


# ----------------------------------------------------------------------------- order


class GlobalSampler:
    """Global position g -> sample id: epoch g // n visits range(n) in a permutation that is a
    pure function of (seed, epoch) (numpy PCG64 seeded with [seed, epoch])."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples}; valid: a positive integer")
        self.num_samples = num_samples
        self.seed = seed
        self._cached: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))

    def permutation(self, epoch: int) -> np.ndarray:
        if self._cached[0] != epoch:  # one epoch cached: positions are consumed in order
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._cached = (epoch, rng.permutation(self.num_samples).astype(np.int64))
        return self._cached[1]

    def sample_ids(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at global positions [start, stop), int64."""
        positions = np.arange(start, stop, dtype=np.int64)
        epochs = positions // self.num_samples
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[positions[sel] % self.num_samples]
        return out


def rank_range(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the step's global_batch samples that `rank` takes: a balanced split where the
    first global_batch % world ranks take one more."""
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}; valid: 0 <= rank < world={world}")
    base, extra = divmod(global_batch, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def global_tokens_per_step(global_batch: int, seq_len: int) -> int:
    """Target tokens in one optimizer step, over all ranks: the loss normaliser."""
    return global_batch * seq_len


# ----------------------------------------------------------------------------- batches


@dataclass
class MicroBatch:
    inputs: torch.Tensor
    """LongTensor [b, T]."""
    targets: torch.Tensor
    """LongTensor [b, T]: inputs shifted by one token."""
    weight: float
    """1.0, or 0.0 for a padding micro-batch (run forward/backward, contribute nothing)."""
    sample_ids: np.ndarray
    """The sample ids in this micro-batch (for a padding one, the id it borrowed)."""

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        return dataclasses.replace(
            self,
            inputs=self.inputs.to(device, non_blocking=non_blocking),
            targets=self.targets.to(device, non_blocking=non_blocking),
        )


class Batcher:
    """One rank's micro-batches of a step, from the global order."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, global_batch: int):
        num_samples = (len(tokens) - 1) // seq_len
        if num_samples <= 0:
            raise ConfigError(
                f"invalid config: data.seq_len={seq_len}; valid: at most "
                f"{max(len(tokens) - 1, 0)} (the prepared corpus has {len(tokens)} "
                "tokens; raise data.max_bytes or use a larger data.source)"
            )
        if global_batch <= 0:
            raise ConfigError(
                f"invalid config: train.global_batch_size={global_batch}; valid: a positive integer"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.sampler = GlobalSampler(num_samples, seed)

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def epoch(self, step: int) -> float:
        """Epochs consumed before `step` (fractional), for logging."""
        return step * self.global_batch / self.num_samples

    def step_ids(self, step: int, rank: int = 0, world: int = 1) -> np.ndarray:
        lo, hi = rank_range(self.global_batch, world, rank)
        start = step * self.global_batch
        return self.sampler.sample_ids(start + lo, start + hi)

    def micro_batches(self, step: int, rank: int, world: int, n_micro: int) -> list[MicroBatch]:
        """Exactly n_micro micro-batches for every rank (collectives run per micro-batch, so all
        ranks must run the same number of forwards). The rank's samples are split with
        np.array_split; an empty split becomes one padding sample (the step's first sample)
        with weight 0.0, which runs forward and backward but adds nothing to loss or gradient.
        """
        if n_micro <= 0:
            raise ConfigError(
                f"invalid config: train.micro_batches={n_micro}; valid: a positive integer"
            )
        ids = self.step_ids(step, rank, world)
        out = []
        for part in np.array_split(ids, n_micro):
            weight = 1.0
            if len(part) == 0:
                start = step * self.global_batch
                part, weight = self.sampler.sample_ids(start, start + 1), 0.0
            out.append(self._micro_batch(part, weight))
        return out

    def _micro_batch(self, ids: np.ndarray, weight: float) -> MicroBatch:
        offsets = ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        window = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return MicroBatch(window[:, :-1].contiguous(), window[:, 1:].contiguous(), weight, ids)
