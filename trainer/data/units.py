"""Step 2 of a preparation: one work unit tokenized into its own shard per split and committed
by a small record file.

`process_unit` is a pure function of the unit, the tokenizer and the settings, so any runner
(this process, Ray Data on a cluster) produces the same bytes. Each document goes to eval when
the crc32 of its bytes says so (data.eval_fraction), the same on every machine. A unit whose
record exists is skipped: a preparation that died resumes where it stopped.

Chat data (data.kind=chat): each record is rendered with the chat template and tokenized with
its loss mask (chat.py); within each unit, whole conversations (truncated to or dropped beyond
W = data.seq_len + 1 tokens, per data.overlong) are packed into windows of W tokens by
best-fit-decreasing (packing.py; data.pack=false: one per window), and each split's shard gets
its mask, positions and per-window loss-token count files beside the tokens (dataset.py).

Images in chat records (chat_images.py): read, decoded and resized when the record is read (a
bad one refuses the preparation, naming the file and the record), spilled to a local temporary
file, then written beside the shard in window order (window_images.py). Each <|image_pad|> is
expanded to its image's tokens before packing, so a conversation's length is its length in
the model; one whose image tokens a truncation would cut is dropped (overlong_image_dropped),
so every image lies whole in one window, with its pixels.
"""

from __future__ import annotations

import functools
import json
import uuid
import zlib
from dataclasses import asdict
from typing import Optional

import numpy as np

from trainer import storage
from trainer.storage import Location

from . import chat as chatlib
from . import window_images
from .chat_images import IMAGES_COLUMN, Vision, Where, image_refs
from .dataset import SPLITS, ShardInfo, extra_name, positions_dtype, shard_name, unit_record_name
from .packing import best_fit_decreasing, build_windows
from .planning import WorkUnit
from .sources import Counts, numbered_records, read_documents
from .tokenizer import Tokenizer, load_tokenizer

ENCODE_BATCH = 512
"""Documents tokenized per call (the tokenizer parallelises inside a batch)."""


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
    vision = Vision.of(settings, tok)
    counts = Counts()
    docs: dict[str, list] = {s: [] for s in SPLITS}
    batch: list = []

    def flush() -> None:
        encodings = tok.model.encode_batch([b[0] for b in batch], add_special_tokens=False)
        for (text, spans, images, where), enc in zip(batch, encodings):
            vision.check(enc.ids, images, where)
            got = chatlib.encoded(text, spans, enc)
            got = got if isinstance(got, str) else vision.expand(got, images)
            got = _fit(got, width, settings["overlong"], counts, vision)
            if isinstance(got, str):
                counts.add(got)
                counts.add("documents", -1)
                continue
            held = settings["eval_fraction"] and _held_out(text, settings["eval_fraction"])
            docs["eval" if held else "train"].append(got)
        batch.clear()

    try:
        for f in unit.files:
            for label, record in numbered_records(f, columns, counts, (IMAGES_COLUMN,)):
                where = Where(f, label)
                got = _conversation(record, columns, template, train_on, eot, vision, where)
                if isinstance(got, str):
                    counts.add(got)
                    counts.add("documents", -1)
                    continue
                batch.append(got)
                if len(batch) >= ENCODE_BATCH:
                    flush()
        flush()
        pad = tok.model.token_to_id(eot)
        name = functools.partial(shard_name, args["digest"], unit.source, unit.index)
        shards = {
            s: _write_windows(
                root, name(s), docs[s], width, pad, settings["pack"], tok.dtype, vision
            )
            for s in SPLITS
        }
    finally:
        vision.close()
    return counts, shards


def _conversation(record, columns, template, train_on, eot, vision: Vision, where: Where):
    """(rendered text, loss spans, images, where) of a record, or the reason it is skipped.
    Its images are read, decoded and resized here: a bad one refuses the preparation."""
    got = chatlib.record_messages(record, *columns)
    if isinstance(got, str):
        return got
    messages, pair = got
    refs = image_refs(messages, record.get(IMAGES_COLUMN), where)
    if train_on == "completion" and not pair:
        return "no_loss_tokens"  # completion has no meaning on message records
    got = chatlib.render_spans(template, messages, train_on, eot)
    if isinstance(got, str):
        return got
    return (*got, vision.load(refs, where), where)


def _fit(got, width: int, overlong: str, counts: Counts, vision: Vision):
    """A conversation cut to the window (data.overlong=truncate) or dropped; the reason when
    it is skipped (no loss token left after truncation; a cut through its images)."""
    if isinstance(got, str) or len(got.ids) <= width:
        return got
    if overlong == "drop":
        return "overlong_dropped"
    if not vision.fits(got, width):
        return "overlong_image_dropped"
    if not got.mask[:width].any():
        return "no_loss_tokens"
    counts.add("overlong_truncated")
    return chatlib.Encoded(got.ids[:width], got.mask[:width], got.text, got.images)


def _write_windows(root, name, docs, width, pad, pack, dtype, vision) -> Optional[ShardInfo]:
    """One split's windows: tokens, mask, positions and per-window loss counts, each a file;
    and the windows' images when they hold any (window_images.py)."""
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
    if any(d.images for d in docs):
        for kind, i in _write_images(root, name, docs, bins, vision).items():
            files[kind] = {"name": i.name, "nbytes": i.nbytes, "crc32": i.crc32, "n": i.tokens}
    t = infos["tokens"]
    return ShardInfo(t.name, t.tokens, len(docs), t.nbytes, t.crc32, len(bins), w.real, files)


def _write_images(root, name, docs, bins, vision: Vision) -> dict[str, ShardInfo]:
    """The images of the windows `bins`, from the unit's spill file, in window order."""
    order, records, firsts = window_images.layout(docs, bins)
    pixels = _ShardWriter(root, extra_name(name, "pixels"), np.dtype(np.uint8))
    for image in order:
        pixels.write(vision.spill.read(image), 0)
    out = {"pixels": pixels.close()}
    for kind, data in (("images", records.reshape(-1)), ("window_images", firsts)):
        writer = _ShardWriter(root, extra_name(name, kind), data.dtype)
        writer.write(data, 0)
        out[kind] = writer.close()
    return out


def _held_out(doc, fraction: float) -> bool:
    data = doc if isinstance(doc, bytes) else doc.encode("utf-8", errors="surrogatepass")
    return zlib.crc32(data) < fraction * 2**32


def _utf8(doc: bytes) -> bool:
    try:
        doc.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
