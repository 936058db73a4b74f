"""Storage: a small wrapper over pyarrow.fs for local paths and URIs (s3://, gs://, hdfs://).

A `Location` is a filesystem plus a path inside it, and remembers how the user spelled it (so
`str(loc.child('x'))` is again a valid path or URI, query string included, e.g.
's3://bucket/run/step_000000020?endpoint_override=host:9000&scheme=http'). Everything the
checkpoints, the prepared data and the run folder do to storage goes through the few functions
here.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs


class StorageError(OSError):
    """A path or URI that cannot be opened; the message names it."""


# Filesystems whose rename is atomic and which we can fsync: commit there is write-tmp + move.
# Object stores (s3, gcs) make an object visible atomically when its single PUT completes.
_RENAME_COMMITS = {"local"}


@dataclass(frozen=True)
class Location:
    fs: pafs.FileSystem
    path: str
    """Path inside `fs`, no trailing slash."""
    display: str
    """The user's spelling without the query string."""
    query: str = ""
    """'?a=b' of a URI, appended to every child's string form."""

    def child(self, name: str) -> "Location":
        return Location(self.fs, f"{self.path}/{name}", f"{self.display}/{name}", self.query)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_local(self) -> bool:
        return self.fs.type_name in _RENAME_COMMITS

    def __str__(self) -> str:
        return self.display + self.query


def resolve(path_or_uri: str, filesystem: Optional[pafs.FileSystem] = None) -> Location:
    """A plain path -> LocalFileSystem with the absolute path; 'scheme://...' -> from_uri.
    With an explicit `filesystem` (e.g. Ray's storage filesystem) the path is used as is."""
    s = str(path_or_uri)
    if filesystem is not None:
        p = s.rstrip("/") or "/"
        return Location(filesystem, p, p)
    if "://" not in s:
        p = os.path.abspath(s)
        return Location(pafs.LocalFileSystem(), p, p)
    base, _, query = s.partition("?")
    try:
        fs, p = pafs.FileSystem.from_uri(s)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for bad URIs
        raise StorageError(f"cannot open storage {s!r}: {e}") from e
    return Location(fs, p.rstrip("/"), base.rstrip("/"), f"?{query}" if query else "")


def list_dir(loc: Location) -> dict[str, pafs.FileInfo]:
    """Entries directly under `loc` by base name; {} if it does not exist (one LIST request)."""
    sel = pafs.FileSelector(loc.path, allow_not_found=True, recursive=False)
    return {info.base_name: info for info in loc.fs.get_file_info(sel)}


def exists(loc: Location) -> bool:
    return loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound


def read_bytes(loc: Location) -> bytes:
    with loc.fs.open_input_stream(loc.path, compression=None) as f:
        return f.read()


def write_bytes(loc: Location, data: bytes) -> None:
    with loc.fs.open_output_stream(loc.path, compression=None) as f:
        f.write(data)
    fsync(loc)


def write_atomic(loc: Location, data: bytes) -> None:
    """Readers see either no file or the whole file, never a prefix.

    Local: write a temporary name, fsync, rename, fsync the directory. Object stores: one PUT
    (the object appears only when its upload completes).
    """
    if not loc.is_local:
        write_bytes(loc, data)
        return
    tmp = Location(loc.fs, f"{loc.path}.tmp-{uuid.uuid4().hex}", loc.display)
    write_bytes(tmp, data)
    loc.fs.move(tmp.path, loc.path)
    fsync(loc, directory=True)


def fsync(loc: Location, directory: bool = False) -> None:
    """Force a local file (or its directory entry) to disk, so a manifest can never be durable
    before the data it commits. A no-op on other filesystems (their close() is durable)."""
    if not loc.is_local:
        return
    path = os.path.dirname(loc.path) if directory else loc.path
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def delete_file(loc: Location) -> None:
    """Delete a file if present."""
    try:
        loc.fs.delete_file(loc.path)
    except FileNotFoundError:
        pass


def delete_dir(loc: Location) -> None:
    try:
        loc.fs.delete_dir(loc.path)
    except FileNotFoundError:
        pass
