"""Preparation: sources -> token shards + manifest, once, in independent work units.

    info = prepare(cfg.data)                      # in this process
    info = prepare(cfg.data, runner=ray_runner)   # the same units as Ray Data tasks (cluster/)

1. `plan_preparation` lists every source's files, loads the tokenizer and cuts the files into
   work units (one JSONL or Parquet file, or text files grouped up to UNIT_BYTES). The digest of
   the file listing (names, sizes, mtimes), the tokenizer and the settings names it: it lives in
   `<prepared_dir>/<digest[:16]>/`, never mixes with another, never changes (DESIGN.md inv. 2).
2. Each unit is tokenized by `process_unit` - a pure function of the unit, the tokenizer and the
   settings - into its own shard per split (train, and eval when data.eval_fraction > 0: each
   document goes to eval when the crc32 of its bytes says so, the same on every machine), then
   a small record file that commits the unit. A unit whose record exists is skipped: a
   preparation that died resumes where it stopped. Any runner (this process, Ray Data on a
   cluster) produces the same bytes.
3. The manifest, assembled from the unit records in unit order, is written last: the commit.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np

from trainer import storage
from trainer.config import ConfigError, DataConfig, TrainerConfig
from trainer.storage import Location

from .dataset import (
    MANIFEST,
    SPLITS,
    Manifest,
    ShardInfo,
    SourceIndex,
    SplitIndex,
    shard_name,
    unit_record_name,
)
from .sources import Counts, InputFile, check_text_column, list_files, read_documents
from .tokenizer import Tokenizer, load_tokenizer

UNIT_BYTES = 64 * 2**20
"""Text files are grouped into work units of about this many input bytes."""
ENCODE_BATCH = 512
"""Documents tokenized per call (the tokenizer parallelises inside a batch)."""
PREPARE_VERSION = 2


@dataclass
class WorkUnit:
    source: int
    index: int
    files: list[InputFile]
    budgets: list[Optional[int]]
    """Per file: bytes to read (the last file before data.max_bytes is cut), None = all."""

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "index": self.index,
            "budgets": self.budgets,
            "files": [asdict(f) for f in self.files],
        }

    @classmethod
    def from_json(cls, d: dict) -> "WorkUnit":
        return cls(d["source"], d["index"], [InputFile(**f) for f in d["files"]], d["budgets"])

    @property
    def input_bytes(self) -> int:
        return sum(
            f.size if b is None else min(b, f.size) for f, b in zip(self.files, self.budgets)
        )


@dataclass
class Plan:
    """What a preparation will do: its digest, where it goes, the units, the tokenizer."""

    cfg: DataConfig
    digest: str
    root: Location
    tokenizer: Tokenizer
    files: list[list[InputFile]]
    units: list[WorkUnit]

    @property
    def settings(self) -> dict:
        return {
            "max_bytes": self.cfg.max_bytes,
            "eval_fraction": self.cfg.eval_fraction,
            "unit_bytes": UNIT_BYTES,
        }

    def unit_args(self) -> dict:
        """What `process_unit` needs besides the unit, as JSON (sent to Ray Data tasks)."""
        tok = self.tokenizer
        return {
            "root": str(self.root),
            "digest": self.digest,
            "settings": self.settings,
            "tokenizer": tok.name,
            "eod_token": getattr(tok, "eod_token", None),
            "text_columns": [s.text_column for s in self.cfg.sources()],
        }


@dataclass
class PreparedInfo:
    """What `prepare` produced (or found). `uri` is absolute: pass it to workers."""

    uri: str
    digest: str
    num_tokens: int
    num_documents: int
    num_files: int
    num_shards: int
    created: bool
    """True if this call wrote the manifest; False if the preparation was complete already."""
    skipped: dict = field(default_factory=dict)


def dataset_dir(prepared_dir: str, digest: str) -> str:
    """Where the preparation with this digest lives under data.prepared_dir."""
    return str(storage.resolve(prepared_dir).child(digest[:16]))


def plan_preparation(cfg: DataConfig) -> Plan:
    """List the sources, load the tokenizer, cut the work units, compute the digest.
    ConfigError (before anything is written) for an empty source or a bad tokenizer."""
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.eod_token)
    sources = cfg.sources()
    files = [
        list_files(s, f"data.mix[{i}].path" if cfg.mix else "data.source")
        for i, s in enumerate(sources)
    ]
    units = []
    for i, source_files in enumerate(files):
        units += _units(i, source_files, cfg.max_bytes)
    listing = [
        [s.path, s.format, s.text_column, [[f.uri, f.size, f.mtime_ns] for f in fs]]
        for s, fs in zip(sources, files)
    ]
    key = [
        PREPARE_VERSION,
        tokenizer.digest,
        tokenizer.eod_id,
        cfg.max_bytes,
        cfg.eval_fraction,
        UNIT_BYTES,
        listing,
    ]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    root = storage.resolve(dataset_dir(cfg.prepared_dir, digest))
    return Plan(cfg, digest, root, tokenizer, files, units)


def plan_and_check(cfg: TrainerConfig) -> Plan:
    """The preparation plan of cfg.data, after the checks a driver makes before any worker
    starts: every source lists files, the tokenizer loads, the first JSONL/Parquet file of each
    source has the text column, and the model has a row for every token id."""
    plan = plan_preparation(cfg.data)
    for spec, files in zip(cfg.data.sources(), plan.files):
        check_text_column(files[0], spec.text_column)
    check_vocab(cfg, plan.tokenizer.vocab_size, cfg.data.tokenizer)
    return plan


def check_vocab(cfg: TrainerConfig, vocab_size: int, tokenizer: str) -> None:
    """The model must have an embedding row for every token id the data can hold."""
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"invalid config: model.vocab_size={cfg.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary of {vocab_size} ({tokenizer}); "
            f"valid: model.vocab_size >= {vocab_size}"
        )


def _units(source: int, files: list[InputFile], max_bytes: int) -> list[WorkUnit]:
    """Consecutive text files up to UNIT_BYTES per unit; a JSONL or Parquet file per unit. With
    max_bytes, files are taken in order until the cap; a text file crossing it is cut there."""
    units, group, budgets, group_bytes, taken = [], [], [], 0, 0
    for f in files:
        if max_bytes and taken >= max_bytes:
            break
        budget = None
        if max_bytes and taken + f.size > max_bytes and f.format == "text" and not f.compression:
            budget = max_bytes - taken
        size = f.size if budget is None else budget
        taken += size
        if f.format != "text" or group_bytes + size > UNIT_BYTES:
            if group:
                units.append(WorkUnit(source, len(units), group, budgets))
            group, budgets, group_bytes = [], [], 0
        group.append(f)
        budgets.append(budget)
        group_bytes += size
        if f.format != "text":
            units.append(WorkUnit(source, len(units), group, budgets))
            group, budgets, group_bytes = [], [], 0
    if group:
        units.append(WorkUnit(source, len(units), group, budgets))
    return units


# ----------------------------------------------------------------------------- one unit


class _ShardWriter:
    """One split's shard of one unit: tokens appended, crc32 on the fly, committed by a move."""

    def __init__(self, root: Location, name: str, dtype: np.dtype):
        self.root, self.name, self.dtype = root, name, dtype
        self.final = root.child(name)
        self.target = (
            self.final if not self.final.is_local else root.child(f".tmp-{uuid.uuid4().hex}-{name}")
        )
        self.stream = None
        self.tokens = self.documents = self.nbytes = self.crc32 = 0

    def write(self, ids: np.ndarray) -> None:
        if self.stream is None:
            self.stream = self.root.fs.open_output_stream(self.target.path, compression=None)
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.stream.write(data)
        self.crc32 = zlib.crc32(data, self.crc32)
        self.tokens += len(ids)
        self.nbytes += len(data)
        self.documents += 1

    def close(self) -> Optional[ShardInfo]:
        if self.stream is None:
            return None
        self.stream.close()
        if self.final.is_local:
            storage.fsync(self.target)
            self.root.fs.move(self.target.path, self.final.path)
        return ShardInfo(self.name, self.tokens, self.documents, self.nbytes, self.crc32)


def process_unit(unit: WorkUnit, args: dict, tokenizer: Optional[Tokenizer] = None) -> dict:
    """Tokenize one unit into its shards and commit it with its record; return the record.
    A unit whose record is already there is not done again."""
    root = storage.resolve(args["root"])
    record_loc = root.child(unit_record_name(args["digest"], unit.source, unit.index))
    try:
        return json.loads(storage.read_bytes(record_loc))
    except FileNotFoundError:
        pass
    tok = tokenizer or load_tokenizer(args["tokenizer"], args["eod_token"])
    eval_fraction = args["settings"]["eval_fraction"]
    dtype = tok.dtype
    writers = {
        s: _ShardWriter(root, shard_name(args["digest"], unit.source, unit.index, s), dtype)
        for s in SPLITS
    }
    counts = Counts()
    text_column = args["text_columns"][unit.source]
    batch: list = []

    def flush() -> None:
        for doc, ids in zip(batch, tok.encode_batch(batch)):
            split = "eval" if eval_fraction and _held_out(doc, eval_fraction) else "train"
            writers[split].write(np.append(np.asarray(ids, dtype=np.int64), tok.eod_id))
        batch.clear()

    for f, budget in zip(unit.files, unit.budgets):
        for doc in read_documents(f, text_column, counts, budget):
            if isinstance(doc, bytes) and not tok.decodes_bytes and not _utf8(doc):
                counts.add("non_utf8")
                counts.add("documents", -1)
                continue
            batch.append(doc)
            if len(batch) >= ENCODE_BATCH:
                flush()
    flush()
    shards = {s: w.close() for s, w in writers.items()}
    record = {
        "source": unit.source,
        "unit": unit.index,
        "input_bytes": unit.input_bytes,
        "files": len(unit.files),
        "counts": dict(counts),
        "shards": {s: asdict(info) for s, info in shards.items() if info is not None},
    }
    storage.write_atomic(record_loc, json.dumps(record).encode())
    return record


def _held_out(doc, fraction: float) -> bool:
    data = doc if isinstance(doc, bytes) else doc.encode("utf-8", errors="surrogatepass")
    return zlib.crc32(data) < fraction * 2**32


def _utf8(doc: bytes) -> bool:
    try:
        doc.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ----------------------------------------------------------------------------- the whole

Runner = Callable[[Plan, list[WorkUnit]], list[dict]]
"""runner(plan, units) -> the units' records, in any order (cluster/ has one on Ray Data)."""


def run_in_process(plan: Plan, units: list[WorkUnit], log=print) -> list[dict]:
    """The units one after another in this process, with a progress line every few seconds."""
    args, records, start, shown = plan.unit_args(), [], time.monotonic(), 0.0
    total = sum(u.input_bytes for u in units)
    done_bytes = 0
    for i, unit in enumerate(units):
        records.append(process_unit(unit, args, plan.tokenizer))
        done_bytes += unit.input_bytes
        now = time.monotonic()
        if now - shown > 5 or i == len(units) - 1:
            shown = now
            rate = done_bytes / max(now - start, 1e-9) / 2**20
            log(
                f"prepare: {i + 1}/{len(units)} units, {done_bytes / 2**20:.1f} of "
                f"{total / 2**20:.1f} MiB of input ({rate:.1f} MiB/s)"
            )
    return records


def find_prepared(plan: Plan) -> Optional[Manifest]:
    """The committed manifest of this plan's digest, if complete (every shard of its size)."""
    try:
        manifest = Manifest.from_json(storage.read_bytes(plan.root.child(MANIFEST)), str(plan.root))
    except FileNotFoundError:
        return None
    listing = storage.list_dir(plan.root)
    for source in manifest.sources:
        for split in source.splits.values():
            for shard in split.shards:
                info = listing.get(shard.name)
                if info is None or info.size != shard.nbytes:
                    return None
    return manifest


def prepare(
    cfg: DataConfig, runner: Optional[Runner] = None, log=print, plan: Optional[Plan] = None
) -> PreparedInfo:
    """Prepare `cfg`'s sources once: nothing is done when the same preparation is complete."""
    plan = plan or plan_preparation(cfg)
    manifest = find_prepared(plan)
    created = manifest is None
    if manifest is None:
        plan.root.fs.create_dir(plan.root.path, recursive=True)
        listing = storage.list_dir(plan.root)
        todo = [
            u for u in plan.units if unit_record_name(plan.digest, u.source, u.index) not in listing
        ]
        if len(todo) < len(plan.units):
            log(
                f"prepare: resuming {plan.root}: {len(plan.units) - len(todo)} of "
                f"{len(plan.units)} units are done already"
            )
        records = (runner or run_in_process)(plan, todo)
        manifest = assemble(plan, _all_records(plan, records))
        storage.write_atomic(plan.root.child(MANIFEST), manifest.to_json())
    info = _info(plan, manifest, created)
    if info.skipped:
        log(
            "prepare: records skipped: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(info.skipped.items()))
        )
    return info


def _all_records(plan: Plan, fresh: list[dict]) -> list[dict]:
    """Every unit's record: the fresh ones, and those a previous run committed."""
    by_key = {(r["source"], r["unit"]): r for r in fresh}
    out = []
    for u in plan.units:
        r = by_key.get((u.source, u.index))
        if r is None:
            loc = plan.root.child(unit_record_name(plan.digest, u.source, u.index))
            r = json.loads(storage.read_bytes(loc))
        out.append(r)
    return out


def assemble(plan: Plan, records: list[dict]) -> Manifest:
    """The manifest of the unit records, in unit order; an empty source is a ConfigError."""
    sources = []
    for i, spec in enumerate(plan.cfg.sources()):
        mine = [r for r in records if r["source"] == i]
        splits = {
            s: SplitIndex([ShardInfo(**r["shards"][s]) for r in mine if s in r["shards"]])
            for s in SPLITS
        }
        counts = Counts()
        for r in mine:
            for k, v in r["counts"].items():
                counts.add(k, v)
        documents = counts.pop("documents", 0)
        if splits["train"].tokens < 2:
            key = f"data.mix[{i}].path" if plan.cfg.mix else "data.source"
            raise ConfigError(
                f"invalid config: {key}={spec.path!r} holds no usable document "
                f"({documents} read, skipped: {dict(counts) or 'none'}); valid: a "
                "source with text"
            )
        sources.append(
            SourceIndex(
                spec.path,
                spec.format,
                spec.text_column,
                files=sum(r["files"] for r in mine),
                input_bytes=sum(r["input_bytes"] for r in mine),
                splits=splits,
                skipped=dict(counts),
            )
        )
    tok = plan.tokenizer
    tokenizer = {
        "name": tok.name,
        "digest": tok.digest,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "eod_token": getattr(tok, "eod_token", None),
    }
    return Manifest(plan.digest, tokenizer, tok.dtype.name, sources, plan.settings, time.time())


def _info(plan: Plan, manifest: Manifest, created: bool) -> PreparedInfo:
    skipped = Counts()
    for s in manifest.sources:
        for k, v in s.skipped.items():
            skipped.add(k, v)
    return PreparedInfo(
        uri=str(plan.root),
        digest=plan.digest,
        num_tokens=sum(sp.tokens for s in manifest.sources for sp in s.splits.values()),
        num_documents=sum(sp.documents for s in manifest.sources for sp in s.splits.values()),
        num_files=sum(s.files for s in manifest.sources),
        num_shards=sum(len(sp.shards) for s in manifest.sources for sp in s.splits.values()),
        created=created,
        skipped=dict(skipped),
    )
