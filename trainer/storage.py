"""Storage: a small wrapper over pyarrow.fs for local paths and URIs (s3://, gs://, hdfs://).

A `Location` is a filesystem plus a path inside it, and remembers how the user spelled it (so
`str(loc.child('x'))` is again a valid path or URI, query string included, e.g.
's3://bucket/run/step_000000020?endpoint_override=host:9000&scheme=http'). Everything the
checkpoints, the prepared data and the run folder do to storage goes through the few functions
here. A scheme pyarrow cannot open by itself (the in-memory snapshot keepers' 'keeper://') is
registered with `register_scheme`, and then resolves like any other URI.
"""

from __future__ import annotations

import os
import re
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

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


SchemeFactory = Callable[[str], tuple[pafs.FileSystem, str]]
"""Turns a whole URI of a registered scheme (query string included) into (filesystem, path)."""

_SCHEMES: dict[str, SchemeFactory] = {}
_SCHEME_NAME = re.compile(r"^[a-z][a-z0-9+.-]*$")  # RFC 3986 scheme syntax, lower case


def register_scheme(scheme: str, factory: SchemeFactory) -> None:
    """Open 'scheme://...' URIs with `factory(uri) -> (filesystem, path)` instead of pyarrow.

    For filesystems pyarrow cannot build from a URI (e.g. the in-memory snapshot keepers of
    cluster/snapshots/keeper_fs.py), so that the checkpoint code, which only ever calls `resolve`,
    runs on them unchanged. A registered scheme takes precedence over pyarrow's own; registering
    it again replaces the factory (each process registers what it needs, possibly twice).
    """
    if not isinstance(scheme, str) or not _SCHEME_NAME.match(scheme):
        raise StorageError(
            f"register_scheme scheme={scheme!r}; valid: a lower-case URI scheme without '://' "
            "(a letter, then letters, digits, '+', '-' or '.'), e.g. 'keeper'"
        )
    if not callable(factory):
        raise StorageError(
            f"register_scheme({scheme!r}) factory={factory!r}; valid: a callable "
            "uri -> (pyarrow filesystem, path)"
        )
    _SCHEMES[scheme] = factory


def unregister_scheme(scheme: str) -> None:
    """Undo register_scheme: 'scheme://...' goes to pyarrow again."""
    if scheme not in _SCHEMES:
        raise StorageError(
            f"unregister_scheme({scheme!r}): not registered; registered: "
            f"{', '.join(sorted(_SCHEMES)) or 'none'}"
        )
    del _SCHEMES[scheme]


def resolve(path_or_uri: str, filesystem: Optional[pafs.FileSystem] = None) -> Location:
    """A plain path -> LocalFileSystem with the absolute path; 'scheme://...' -> the factory
    registered for the scheme (register_scheme), else pyarrow's from_uri.
    With an explicit `filesystem` (e.g. Ray's storage filesystem) the path is used as is."""
    s = str(path_or_uri)
    if filesystem is not None:
        p = s.rstrip("/") or "/"
        return Location(filesystem, p, p)
    if "://" not in s:
        p = os.path.abspath(s)
        return Location(pafs.LocalFileSystem(), p, p)
    base, _, query = s.partition("?")
    factory = _SCHEMES.get(s.partition("://")[0].lower())
    try:
        fs, p = factory(s) if factory is not None else pafs.FileSystem.from_uri(s)
    except StorageError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for bad URIs
        raise StorageError(f"cannot open storage {s!r}: {e}") from e
    if not isinstance(fs, pafs.FileSystem) or not isinstance(p, str):
        raise StorageError(
            f"cannot open storage {s!r}: the factory registered for its scheme returned "
            f"({type(fs).__name__}, {type(p).__name__}); valid: (pyarrow.fs.FileSystem, str)"
        )
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


def create_exclusive(loc: Location, data: bytes) -> bool:
    """Create `loc` holding `data` only if nothing is there: True if this call created it, False
    if it existed (someone else won). Atomic against concurrent creators, and never seen
    half-written: on local (and NFS) filesystems the data goes to a temporary file that is then
    hard-linked to the name (link fails if the name exists); on S3 it is a conditional PUT
    (If-None-Match: *, honoured by AWS S3 and most S3-compatible stores). Other filesystems raise
    StorageError: there is no race-free way to do it through pyarrow.fs."""
    if loc.is_local:
        tmp = f"{loc.path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, loc.path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        fsync(loc, directory=True)
        return True
    if loc.fs.type_name == "s3":
        return _s3_put_if_absent(loc, data)
    raise StorageError(
        f"{loc}: cannot create a file exclusively on a {loc.fs.type_name!r} filesystem "
        "(supported: local paths, including shared mounts, and s3://)"
    )


def _s3_put_if_absent(loc: Location, data: bytes) -> bool:
    import boto3  # noqa: PLC0415 -- only where an S3 run lease is taken
    from botocore.exceptions import ClientError  # noqa: PLC0415

    query = dict(urllib.parse.parse_qsl(loc.query.lstrip("?")))
    endpoint = query.get("endpoint_override")
    if endpoint and "://" not in endpoint:
        endpoint = f"{query.get('scheme', 'https')}://{endpoint}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name=query.get("region"))
    bucket, _, key = loc.path.partition("/")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
            return False
        raise StorageError(f"cannot create {loc}: {e}") from e
    return True
