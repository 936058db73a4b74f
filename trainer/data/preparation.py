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

Chat data (data.kind=chat): each record is rendered with the chat template and tokenized with
its loss mask (chat.py); within each unit, whole conversations (truncated to or dropped beyond
W = data.seq_len + 1 tokens, per data.overlong) are packed into windows of W tokens by
best-fit-decreasing (packing.py; data.pack=false: one per window), and each split's shard gets
its mask, positions and per-window loss-token count files beside the tokens (dataset.py).
The digest then also holds the kind, the template's sha256, the end-of-turn token, train_on,
pack, overlong, seq_len and the columns; a text preparation's digest is as it always was.
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

from . import chat as chatlib
from .dataset import (
    MANIFEST,
    SPLITS,
    STREAM,
    Manifest,
    ShardInfo,
    SourceIndex,
    SplitIndex,
    extra_name,
    positions_dtype,
    shard_name,
    unit_record_name,
)
from .packing import best_fit_decreasing, build_windows
from .sources import (
    Counts,
    InputFile,
    check_text_column,
    first_record_fields,
    list_files,
    missing_chat_columns,
    read_documents,
    read_records,
)
from .tokenizer import Tokenizer, load_tokenizer

UNIT_BYTES = 64 * 2**20
"""Text files are grouped into work units of about this many input bytes."""
ENCODE_BATCH = 512
"""Documents tokenized per call (the tokenizer parallelises inside a batch)."""
PREPARE_VERSION = 2
AUTO_RAY_BYTES = 256 * 2**20
"""data.prepare_with=auto prepares on Ray Data above this many bytes of sources (`on_ray_data`);
below, the driver prepares in its own process, before Ray starts (cluster/preflight.py)."""


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
    tokenizer_config: Optional[dict] = None
    """The tokenizer_config.json beside data.tokenizer, as read (None: there is none)."""
    template: Optional[chatlib.ChatTemplate] = None
    """The chat template: data.kind=chat always; text when one is known (for the export)."""
    eot_token: Optional[str] = None
    prepared: Optional["PreparedInfo"] = None
    """What `prepare` made of this plan in this process: a second `prepare` of the same plan (the
    driver's preflight prepared small data, the launch asks again) returns it as it was, `created`
    included, without reading the storage again."""

    @property
    def is_chat(self) -> bool:
        return self.cfg.kind == "chat"

    @property
    def settings(self) -> dict:
        out = {
            "max_bytes": self.cfg.max_bytes,
            "eval_fraction": self.cfg.eval_fraction,
            "unit_bytes": UNIT_BYTES,
        }
        if self.is_chat:
            c = self.cfg
            out.update(
                kind="chat",
                train_on=c.train_on,
                pack=c.pack,
                overlong=c.overlong,
                width=c.seq_len + 1,
                eot_token=self.eot_token,
                columns=[c.messages_column, c.prompt_column, c.completion_column],
            )
        return out

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
            **({"chat": self.chat_args()} if self.is_chat else {}),
        }

    def chat_args(self) -> dict:
        return {"template": self.template.text, "tokens": self.template.tokens}


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
    try:
        config = chatlib.read_tokenizer_config(cfg.tokenizer)
    except ConfigError:
        if cfg.kind == "chat":
            raise
        config = None  # text never needed it: a broken one beside the tokenizer is not fatal
    template, eot = _template_and_eot(cfg, config, tokenizer)
    if cfg.kind == "chat":  # text keeps its digest: prepared text data stays valid
        key.append(
            {
                "kind": "chat",
                "template_sha256": template.sha256,
                "eot_token": eot,
                "train_on": cfg.train_on,
                "pack": cfg.pack,
                "overlong": cfg.overlong,
                "seq_len": cfg.seq_len,
                "columns": [cfg.messages_column, cfg.prompt_column, cfg.completion_column],
            }
        )
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    root = storage.resolve(dataset_dir(cfg.prepared_dir, digest))
    return Plan(cfg, digest, root, tokenizer, files, units, config, template, eot)


def _template_and_eot(cfg: DataConfig, config: Optional[dict], tokenizer: Tokenizer):
    """(chat template, end-of-turn token) of cfg: required for chat (ConfigError naming where
    it looked), for text whatever is known (None when nothing is)."""
    if cfg.kind != "chat":
        if tokenizer.name == "byte":
            return None, None
        try:
            template = chatlib.load_chat_template(cfg, config)
        except ConfigError:
            template = None
        eot = cfg.eot_token or chatlib.token_text((config or {}).get("eos_token"))
        return template, eot
    template = chatlib.load_chat_template(cfg, config)
    eot = cfg.eot_token or chatlib.token_text((config or {}).get("eos_token"))
    eot = eot or getattr(tokenizer, "eod_token", None)
    if tokenizer.model.token_to_id(eot) is None:
        given = (
            f"data.eot_token={eot!r}"
            if cfg.eot_token
            else f"data.eot_token=None (the tokenizer_config's eos_token {eot!r})"
        )
        raise ConfigError(
            f"invalid config: {given} is not a token of {cfg.tokenizer}; valid: "
            f"data.eot_token=<the special token that ends an assistant turn: one of "
            f"{', '.join(tokenizer._special_tokens()) or 'it has none'}>"
        )
    return template, eot


def on_ray_data(cfg: DataConfig, plan: Plan) -> bool:
    """Whether `plan` is prepared on Ray Data (data.prepare_with=ray, or auto with more than
    AUTO_RAY_BYTES of sources) rather than in the driver's process."""
    if cfg.prepare_with != "auto":
        return cfg.prepare_with == "ray"
    return sum(u.input_bytes for u in plan.units) > AUTO_RAY_BYTES


def plan_and_check(cfg: TrainerConfig) -> Plan:
    """The preparation plan of cfg.data, after the checks a driver makes before any worker
    starts: every source lists files, the tokenizer loads, the first JSONL/Parquet file of each
    source has the text column, and the model has a row for every token id."""
    plan = plan_preparation(cfg.data)
    if plan.is_chat:
        check_chat(plan)
    else:
        for spec, files in zip(cfg.data.sources(), plan.files):
            check_text_column(files[0], spec.text_column)
    check_vocab(cfg, plan.tokenizer.vocab_size, cfg.data.tokenizer)
    return plan


def check_chat(plan: Plan) -> None:
    """Chat: the template renders the end-of-turn token for a sample conversation, and the
    first record of each source holds the messages or the prompt/completion columns (and
    messages are not asked to be trained on as completions). ConfigError otherwise."""
    cfg, eot = plan.cfg, plan.eot_token
    try:
        text = plan.template.render(chatlib.SAMPLE_CONVERSATION)
    except Exception as e:  # noqa: BLE001 -- any template failure is the user's to see
        raise ConfigError(
            f"invalid config: the chat template from {plan.template.origin} fails on a sample "
            f"conversation ({type(e).__name__}: {e}); valid: a template that renders "
            "user/assistant turns"
        ) from None
    reply = chatlib.SAMPLE_CONVERSATION[-1]["content"]
    if eot not in text[text.find(reply) :]:
        raise ConfigError(
            f"invalid config: data.eot_token={eot!r} is never rendered by the chat template "
            f"from {plan.template.origin} after an assistant turn (sample: {text!r}); valid: "
            "data.eot_token=<the token the template ends assistant turns with>"
        )
    columns = (cfg.messages_column, cfg.prompt_column, cfg.completion_column)
    for files in plan.files:
        names = first_record_fields(files[0])
        has_pair = cfg.prompt_column in names and cfg.completion_column in names
        if cfg.messages_column not in names and not has_pair:
            raise ConfigError(missing_chat_columns(files[0], columns, names, "first record"))
        if cfg.train_on == "completion" and cfg.messages_column in names:
            raise ConfigError(
                f"invalid config: data.train_on='completion' with message records "
                f"({files[0].uri} has {cfg.messages_column!r}); valid: last_assistant (the "
                "final reply), assistant or all; completion is for prompt/completion records"
            )


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

    def write(self, ids: np.ndarray, documents: int = 1) -> None:
        if self.stream is None:
            self.stream = self.root.fs.open_output_stream(self.target.path, compression=None)
        data = ids.astype(self.dtype, copy=False).tobytes()
        self.stream.write(data)
        self.crc32 = zlib.crc32(data, self.crc32)
        self.tokens += len(ids)
        self.nbytes += len(data)
        self.documents += documents

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
    if "chat" in args:
        return _commit(record_loc, unit, *_chat_unit(unit, args, tok, root))
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
    return _commit(record_loc, unit, counts, shards)


def _commit(record_loc: Location, unit: WorkUnit, counts: Counts, shards: dict) -> dict:
    """Write the unit's record (its commit) and return it."""
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


def _chat_unit(unit: WorkUnit, args: dict, tok: Tokenizer, root: Location):
    """(counts, shards) of a chat unit: records -> conversations -> windows, per split."""
    settings = args["settings"]
    width, eot, train_on = settings["width"], settings["eot_token"], settings["train_on"]
    columns = tuple(settings["columns"])
    template = chatlib.ChatTemplate(args["chat"]["template"], args["chat"]["tokens"])
    counts = Counts()
    docs: dict[str, list] = {s: [] for s in SPLITS}
    batch: list = []

    def flush() -> None:
        encodings = tok.model.encode_batch([t for t, _ in batch], add_special_tokens=False)
        for (text, spans), enc in zip(batch, encodings):
            got = chatlib.encoded(text, spans, enc)
            got = _fit(got, width, settings["overlong"], counts)
            if isinstance(got, str):
                counts.add(got)
                counts.add("documents", -1)
                continue
            held = settings["eval_fraction"] and _held_out(text, settings["eval_fraction"])
            docs["eval" if held else "train"].append(got)
        batch.clear()

    for f in unit.files:
        for record in read_records(f, columns, counts):
            got = chatlib.record_messages(record, *columns)
            if not isinstance(got, str):
                messages, pair = got
                if train_on == "completion" and not pair:
                    got = "no_loss_tokens"  # completion has no meaning on message records
                else:
                    got = chatlib.render_spans(template, messages, train_on, eot)
            if isinstance(got, str):
                counts.add(got)
                counts.add("documents", -1)
                continue
            batch.append(got)
            if len(batch) >= ENCODE_BATCH:
                flush()
    flush()
    pad = tok.model.token_to_id(eot)
    shards = {
        s: _write_windows(
            root,
            shard_name(args["digest"], unit.source, unit.index, s),
            docs[s],
            width,
            pad,
            settings["pack"],
            tok.dtype,
        )
        for s in SPLITS
    }
    return counts, shards


def _fit(got, width: int, overlong: str, counts: Counts):
    """A conversation cut to the window (data.overlong=truncate) or dropped; the reason when
    it is skipped (no loss token left after truncation)."""
    if isinstance(got, str) or len(got.ids) <= width:
        return got
    if overlong == "drop":
        return "overlong_dropped"
    if not got.mask[:width].any():
        return "no_loss_tokens"
    counts.add("overlong_truncated")
    return chatlib.Encoded(got.ids[:width], got.mask[:width], got.text)


def _write_windows(root, name, docs, width, pad, pack, dtype) -> Optional[ShardInfo]:
    """One split's windows: tokens, mask, positions and per-window loss counts, each a file."""
    if not docs:
        return None
    lengths = [len(d.ids) for d in docs]
    bins = best_fit_decreasing(lengths, width) if pack else [[i] for i in range(len(docs))]
    w = build_windows([d.ids for d in docs], [d.mask for d in docs], bins, width, pad)
    parts = {
        "tokens": (name, w.tokens.reshape(-1), dtype),
        "mask": (extra_name(name, "mask"), w.mask.reshape(-1), np.dtype(np.uint8)),
        "positions": (
            extra_name(name, "positions"),
            w.positions.reshape(-1),
            positions_dtype(width),
        ),
        "counts": (extra_name(name, "counts"), w.counts, np.dtype(np.uint32)),
    }
    infos = {}
    for kind, (fname, data, dt) in parts.items():
        writer = _ShardWriter(root, fname, dt)
        writer.write(data, len(docs))
        infos[kind] = writer.close()
    files = {
        k: {"name": i.name, "nbytes": i.nbytes, "crc32": i.crc32}
        for k, i in infos.items()
        if k != "tokens"
    }
    t = infos["tokens"]
    return ShardInfo(t.name, t.tokens, len(docs), t.nbytes, t.crc32, len(bins), w.real, files)


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
                for f in [shard] + [shard.extra(k) for k in shard.files]:
                    info = listing.get(f.name)
                    if info is None or info.size != f.nbytes:
                        return None
    return manifest


def prepare(
    cfg: DataConfig, runner: Optional[Runner] = None, log=print, plan: Optional[Plan] = None
) -> PreparedInfo:
    """Prepare `cfg`'s sources once: nothing is done when the same preparation is complete."""
    plan = plan or plan_preparation(cfg)
    if plan.prepared is not None:
        return plan.prepared
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
    plan.prepared = info
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
                plan.cfg.messages_column if plan.is_chat else spec.text_column,
                files=sum(r["files"] for r in mine),
                input_bytes=sum(r["input_bytes"] for r in mine),
                splits=splits,
                skipped=dict(counts),
            )
        )
    tok = plan.tokenizer
    layout = dict(STREAM)
    if plan.is_chat:
        width = plan.cfg.seq_len + 1
        layout = {"kind": "windows", "width": width, "positions_dtype": positions_dtype(width).name}
    manifest = Manifest(
        plan.digest, tokenizer_info(plan), tok.dtype.name, sources, plan.settings, time.time()
    )
    manifest.layout = layout
    return manifest


def tokenizer_info(plan: Plan) -> dict:
    """The manifest's tokenizer: name, digest, vocab_size, eod_id, eod_token; and, when a
    tokenizer_config.json or a chat template is known, what generation and the export need."""
    tok = plan.tokenizer
    info = {
        "name": tok.name,
        "digest": tok.digest,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "eod_token": getattr(tok, "eod_token", None),
    }
    if plan.tokenizer_config is None and plan.template is None:
        return info
    config = plan.tokenizer_config or {}
    named = chatlib.special_tokens(config)

    def id_of(token: Optional[str]) -> Optional[int]:
        return tok.model.token_to_id(token) if token is not None else None

    eos, eot = named.get("eos_token"), plan.eot_token
    stop_ids = []
    for i in (id_of(eot), id_of(eos), tok.eod_id):
        if i is not None and i not in stop_ids:
            stop_ids.append(i)
    info.update(
        chat_template=plan.template.text if plan.template else None,
        tokenizer_config=plan.tokenizer_config,
        bos_token=named.get("bos_token"),
        bos_id=id_of(named.get("bos_token")),
        eos_token=eos,
        eot_token=eot,
        stop_ids=stop_ids,
    )
    return info


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
