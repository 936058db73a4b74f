"""Sources of documents: which files a source names, and the documents in them.

    files = list_files(SourceConfig("s3://bucket/corpus/*.parquet", format="parquet"))
    for doc in read_documents(file, "text", counts): ...

A source is 'stdlib' (this interpreter's standard library, the default corpus), a file, a
folder (every file below it; hidden files, __pycache__ and site-packages skipped; with format
text or auto, files with a NUL byte in their first 8 KiB are skipped as binary), or a glob
(`*`, `?`, `[...]`, and `**` across folders) on a local path or any pyarrow.fs URI. Files are
sorted by their path below the source's root, so a listing is the same on every machine.

Chat records (data.kind=chat, `read_records`): a JSONL object or a Parquet row holding a
message list (Parquet: list<struct<role, content>>, content a string or a list of parts) or a
prompt and a completion; a record is yielded as a dict of those fields (`numbered_records`:
with its place in the file, for messages that name it), and checked and rendered by
preparation (chat.py, chat_images.py).

Formats: text (the file's bytes are one document), jsonl (one JSON object per line, its
`text_column` field is the document; .gz / .zst / .bz2 are read compressed), parquet (one row per
document, from column `text_column`). A record that cannot be read is skipped and counted by
reason, never silently; a field or column that is missing altogether is a ConfigError naming it
and the ones present.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Optional

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trainer import storage
from trainer.config import ConfigError, SourceConfig, fail
from trainer.storage import Location

SNIFF_BYTES = 8192
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2"}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class InputFile:
    """One file of a source, as listed (size and mtime go into the preparation's digest)."""

    uri: str
    """How to name it to the user and to `storage.resolve` (a path or URI)."""
    size: int
    mtime_ns: int
    format: str
    """text, jsonl or parquet."""

    @property
    def compression(self) -> Optional[str]:
        for suffix, codec in COMPRESSIONS.items():
            if self.uri.split("?")[0].endswith(suffix):
                return codec
        return None


def detect_format(name: str) -> str:
    base = name.split("?")[0].lower()
    for suffix in COMPRESSIONS:
        base = base.removesuffix(suffix)
    if base.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if base.endswith(JSON_SUFFIXES):
        return "jsonl"
    return "text"


def list_files(source: SourceConfig, key: str = "data.source") -> list[InputFile]:
    """The files `source` names, sorted; ConfigError naming `key` if there are none."""
    spec = source.path
    if spec == "stdlib":
        root = storage.resolve(sysconfig.get_paths()["stdlib"])
        files = _walk(root, None, lambda rel: rel.endswith(".py"))
        return [_input(root, rel, info, "text") for rel, info in files]
    base, pattern, query = _split_glob(spec)
    root = storage.resolve(base + query)
    info = root.fs.get_file_info(root.path)
    if pattern is None and info.type == pafs.FileType.File:
        return [_input_file(spec, info, source.format)]
    if info.type == pafs.FileType.NotFound:
        fail(key, spec, "an existing file, folder, glob or URI (no such file or folder)")
    files = _walk(root, pattern, lambda rel: True)
    out = [_input(root, rel, i, _format(source.format, rel)) for rel, i in files]
    out = [f for f in out if f.format != "text" or _is_text(f)]
    if not out:
        what = f"files matching {pattern!r} under {base}" if pattern else "files in the folder"
        fail(key, spec, f"a source with documents (found no {what})")
    return out


def _split_glob(spec: str) -> tuple[str, Optional[str], str]:
    """('s3://b/corpus', '**/*.parquet', '?query') for 's3://b/corpus/**/*.parquet?query'."""
    path, _, query = spec.partition("?")
    query = f"?{query}" if query else ""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _GLOB.search(part):
            return "/".join(parts[:i]) or "/", "/".join(parts[i:]), query
    return path.rstrip("/") or "/", None, query


def _walk(root: Location, pattern: Optional[str], keep) -> list[tuple[str, pafs.FileInfo]]:
    """(path relative to root, info) of the files below root, sorted, hidden/cache dirs skipped."""
    recursive = pattern is None or "/" in pattern or "**" in pattern
    selector = pafs.FileSelector(root.path, recursive=recursive, allow_not_found=True)
    found = []
    for info in root.fs.get_file_info(selector):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(root.path) :].lstrip("/")
        parts = rel.split("/")
        if any(p.startswith(".") or p in SKIP_DIRS for p in parts):
            continue
        if pattern is not None and not _matches(rel, pattern):
            continue
        if keep(rel):
            found.append((rel, info))
    return sorted(found, key=lambda x: x[0])


def _matches(rel: str, pattern: str) -> bool:
    if "**" in pattern:  # '**/' matches any number of folders, including none
        return fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(
            rel, pattern.replace("**/", "")
        )
    return rel.count("/") == pattern.count("/") and fnmatch.fnmatchcase(rel, pattern)


def _format(configured: str, name: str) -> str:
    return detect_format(name) if configured == "auto" else configured


def _input(root: Location, rel: str, info: pafs.FileInfo, fmt: str) -> InputFile:
    uri = str(root.child(rel)) if rel else str(root)
    return InputFile(uri, info.size, info.mtime_ns or 0, fmt)


def _input_file(spec: str, info: pafs.FileInfo, configured: str) -> InputFile:
    return InputFile(spec, info.size, info.mtime_ns or 0, _format(configured, spec))


def _is_text(f: InputFile) -> bool:
    """No NUL byte in the first 8 KiB (compressed files are taken on trust)."""
    if f.compression:
        return True
    loc = storage.resolve(f.uri)
    try:
        with loc.fs.open_input_file(loc.path) as h:
            return b"\0" not in h.read_at(min(SNIFF_BYTES, f.size), 0)
    except OSError:
        return False


# ----------------------------------------------------------------------------- documents


class Counts(dict):
    """Documents read and records skipped, by reason (a dict, so it travels as JSON)."""

    def add(self, key: str, n: int = 1) -> None:
        self[key] = self.get(key, 0) + n


def read_documents(
    f: InputFile, text_column: str, counts: Counts, byte_budget: Optional[int] = None
) -> Iterator:
    """The documents of one file: bytes (text files, and Parquet binary columns) or str.
    `byte_budget` cuts a text file at that many bytes (data.max_bytes)."""
    loc = storage.resolve(f.uri)
    if f.format == "parquet":
        yield from _parquet_documents(loc, f, text_column, counts)
        return
    with loc.fs.open_input_stream(loc.path, compression=f.compression) as stream:
        if f.format == "text":
            data = stream.read() if byte_budget is None else stream.read(byte_budget)
            counts.add("documents")
            yield data
            return
        yield from _jsonl_documents(stream, f, text_column, counts)


def _jsonl_objects(stream, counts: Counts) -> Iterator[tuple[int, dict]]:
    """(line number, record) of each line holding a JSON object; other lines are counted (not
    UTF-8, not JSON, not an object) and skipped, blank lines ignored."""
    for number, line in enumerate(_lines(stream), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            counts.add("non_utf8")
            continue
        except ValueError:  # not JSON
            counts.add("unreadable")
            continue
        if not isinstance(record, dict):
            counts.add("unreadable")
            continue
        yield number, record


def _jsonl_documents(stream, f: InputFile, text_column: str, counts: Counts) -> Iterator[str]:
    seen_field = False
    for number, record in _jsonl_objects(stream, counts):
        if text_column not in record:
            if not seen_field:
                _missing(f, text_column, sorted(record), "field", f"line {number}")
            counts.add("missing_text")
            continue
        seen_field = True
        text = record[text_column]
        if not isinstance(text, str):
            counts.add("not_text")
            continue
        counts.add("documents")
        yield text


def _lines(stream, chunk: int = 4 * 2**20) -> Iterator[bytes]:
    rest = b""
    while data := stream.read(chunk):
        data = rest + data
        lines = data.split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def _parquet_documents(loc: Location, f: InputFile, text_column: str, counts: Counts):
    with loc.fs.open_input_file(loc.path) as handle:
        try:
            pf = pq.ParquetFile(handle)
        except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not Parquet
            raise ConfigError(
                f"invalid data: {f.uri} is not a readable Parquet file ({e})"
            ) from None
        names = pf.schema_arrow.names
        if text_column not in names:
            _missing(f, text_column, names, "column", "its schema")
        for batch in pf.iter_batches(columns=[text_column], batch_size=1024):
            for value in batch.column(0).to_pylist():
                if value is None or not isinstance(value, (str, bytes)):
                    counts.add("not_text")
                    continue
                counts.add("documents")
                yield value


def check_text_column(f: InputFile, text_column: str) -> None:
    """ConfigError naming the column and those present, if the first record of `f` (a JSONL or
    Parquet file) has no `text_column`: called on the driver, before any worker starts."""
    loc = storage.resolve(f.uri)
    if f.format == "parquet":
        with loc.fs.open_input_file(loc.path) as handle:
            try:
                names = pq.ParquetFile(handle).schema_arrow.names
            except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not Parquet
                raise ConfigError(
                    f"invalid data: {f.uri} is not a readable Parquet file ({e})"
                ) from None
        if text_column not in names:
            _missing(f, text_column, names, "column", "its schema")
    elif f.format == "jsonl":
        next(_jsonl_documents_first(loc, f, text_column), None)


def _jsonl_documents_first(loc: Location, f: InputFile, text_column: str):
    with loc.fs.open_input_stream(loc.path, compression=f.compression) as stream:
        yield from _jsonl_documents(stream, f, text_column, Counts())


def _missing(f: InputFile, column: str, present: list[str], what: str, where: str):
    raise ConfigError(
        f"invalid config: data.text_column={column!r}: {f.uri} has no such {what} ({where}); "
        f"valid: one of {', '.join(map(repr, present)) or '(none)'}"
    )


# ----------------------------------------------------------------------------- chat records


def read_records(f: InputFile, columns: tuple[str, ...], counts: Counts) -> Iterator[dict]:
    """The chat records of a JSONL or Parquet file: dicts of the `columns` they hold (messages,
    prompt, completion). Unreadable lines are skipped and counted."""
    for _, record in numbered_records(f, columns, counts):
        yield record


def numbered_records(
    f: InputFile, columns: tuple[str, ...], counts: Counts, extra: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict]]:
    """(where, record) of each chat record of a file: `where` names it to the user ("record 3
    (line 5)" in JSONL, "record 3" in Parquet: its index among the file's records, from 0).
    Parquet also reads the `extra` columns it has (a record's images)."""
    loc = storage.resolve(f.uri)
    if f.format == "parquet":
        with loc.fs.open_input_file(loc.path) as handle:
            pf = _parquet(handle, f)
            present = [c for c in columns if c in pf.schema_arrow.names]
            if not present:
                _missing_chat(f, columns, pf.schema_arrow.names, "columns", "its schema")
            present += [c for c in extra if c in pf.schema_arrow.names and c not in present]
            index, rows = 0, _batch_rows(pf.schema_arrow, present)
            for batch in pf.iter_batches(columns=present, batch_size=rows):
                for record in batch.to_pylist():
                    counts.add("documents")
                    yield f"record {index}", record
                    index += 1
        return
    if f.format != "jsonl":
        raise ConfigError(
            f"invalid config: data.format={f.format!r} for {f.uri} with data.kind=chat; valid: "
            "jsonl or parquet (chat records are JSON objects or Parquet rows)"
        )
    with loc.fs.open_input_stream(loc.path, compression=f.compression) as stream:
        for index, (line, record) in enumerate(_jsonl_objects(stream, counts)):
            counts.add("documents")
            yield f"record {index} (line {line})", record


def _batch_rows(schema, columns: list[str]) -> int:
    """Rows read at a time: 1024, or 32 where a column holds binary data (images: a batch of
    1024 rows of images would be a GiB in memory at once)."""
    types = " ".join(str(schema.field(c).type) for c in columns)
    return 32 if "binary" in types else 1024


def first_record_fields(f: InputFile) -> list[str]:
    """The fields of the first record of a JSONL file, or the columns of a Parquet file (run
    on the driver, before any worker starts)."""
    loc = storage.resolve(f.uri)
    if f.format == "parquet":
        with loc.fs.open_input_file(loc.path) as handle:
            return list(_parquet(handle, f).schema_arrow.names)
    first = next(iter(read_records(f, (), Counts())), None)
    return sorted(first) if first is not None else []


def _parquet(handle, f: InputFile) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(handle)
    except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not Parquet
        raise ConfigError(f"invalid data: {f.uri} is not a readable Parquet file ({e})") from None


def _missing_chat(f: InputFile, columns, present, what: str, where: str):
    raise ConfigError(missing_chat_columns(f, columns, present, f"{what}, {where}"))


def missing_chat_columns(f: InputFile, columns, present, where: str) -> str:
    messages, prompt, completion = columns
    return (
        f"invalid config: data.messages_column={messages!r} (or data.prompt_column={prompt!r} "
        f"with data.completion_column={completion!r}): {f.uri} has none of them ({where}); "
        f"valid: one of {', '.join(map(repr, present)) or '(none)'}"
    )
