"""The keeper:// filesystem: a run's keepers (keepers.py) as one pyarrow filesystem, so that the
checkpoint code, which only ever calls trainer.storage.resolve, writes and reads snapshots there
unchanged.

Files written go to two keepers, the writing process's node's and its peer's (the package's
docstring: cluster/snapshots/__init__.py). Reads go to any live keeper holding the file, this
node's first, and fetch only the byte range asked for (the checkpoint reader reads by range).
Directories are implicit: one exists while a file lies under it, and create_dir does nothing.
"""

from __future__ import annotations

import io
import time
import urllib.parse
from typing import Optional

import pyarrow as pa
import pyarrow.fs as pafs
import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from cluster.snapshots.keepers import _forget, check_run_key, ensure_keeper, keepers
from trainer import storage

SCHEME = "keeper"

CALL_TIMEOUT_S = 300.0
"""The longest this process waits for one keeper call (a put of a multi-GB shard file
included). A keeper that does not answer by then is treated like a lost one for that call: a
put fails the snapshot (training goes on), a read asks the next copy, a listing leaves it out.
Ray ends calls to a dead node's actors itself (its health check); this bounds what it would
not: a keeper alive but stuck."""


def snapshots_url(run_key: str) -> str:
    """Where the snapshots of `run_key`'s launch live: keeper://<run_key>/snapshots."""
    return f"{SCHEME}://{run_key}/snapshots"


def register_keeper_scheme() -> None:
    """Make trainer.storage open "keeper://<run_key>/<path>" on the keepers of `run_key`, with
    this process's node as the home node of what it writes. Call it in each process (worker,
    driver, test) before it resolves such a URI; calling it again is harmless."""
    storage.register_scheme(SCHEME, _open_keeper_uri)


def _open_keeper_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    if not ray.is_initialized():
        raise storage.StorageError(
            f"cannot open storage {uri!r}: keeper:// needs this process connected to Ray "
            "(ray.init, or a Ray worker)"
        )
    parts = urllib.parse.urlsplit(uri)
    home = ray.get_runtime_context().get_node_id()
    return pafs.PyFileSystem(KeeperFileSystem(parts.netloc, home)), "/" + parts.path.strip("/")


def _key(path: str) -> str:
    """A path as keepers store it: '/a/b/' and 'a/b' are both 'a/b'; the root is ''."""
    return path.strip("/")


class KeeperFileSystem(pafs.FileSystemHandler):
    """The keepers of one run as a pyarrow filesystem; use it as
    `pafs.PyFileSystem(KeeperFileSystem(run_key, home_node_id))` (or through keeper:// URIs).
    Files written go to the home node's keeper and its peer's (cluster/snapshots/__init__.py)."""

    def __init__(self, run_key: str, home_node_id: str):
        check_run_key(run_key)
        self.run_key, self.home = run_key, home_node_id

    def __reduce__(self):
        return KeeperFileSystem, (self.run_key, self.home)

    def __eq__(self, other) -> bool:
        return isinstance(other, KeeperFileSystem) and (self.run_key, self.home) == (
            other.run_key,
            other.home,
        )

    def __hash__(self) -> int:
        return hash((self.run_key, self.home))

    def equals(self, other) -> bool:
        return self == other

    def get_type_name(self) -> str:
        return SCHEME

    def normalize_path(self, path: str) -> str:
        return "/" + _key(path)

    # ------------------------------------------------------------------ keepers

    def _where(self, key: str) -> str:
        return f"keeper://{self.run_key}/{key}"

    def _ask(
        self, method: str, *args, among: Optional[dict[str, ActorHandle]] = None
    ) -> dict[str, object]:
        """`method(*args)` on every live keeper (or those `among`) at once: node id -> answer.
        A keeper that dies meanwhile is left out, and so are the copies it held."""
        among = keepers(self.run_key) if among is None else among
        refs = {n: getattr(h, method).remote(*args) for n, h in among.items()}
        out = {}
        deadline = time.monotonic() + CALL_TIMEOUT_S
        for node, ref in refs.items():
            try:
                out[node] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except (RayActorError, GetTimeoutError):
                _forget(self.run_key, [node])
        return out

    def _targets(self) -> dict[str, ActorHandle]:
        """The keepers a file written now goes to: home's and its peer's (one when alone)."""
        found = keepers(self.run_key)
        if self.home not in found:
            found[self.home] = ensure_keeper(self.run_key, self.home)
        nodes = sorted(found)
        peer = nodes[(nodes.index(self.home) + 1) % len(nodes)]
        return {n: found[n] for n in (self.home, peer)}

    def _store(self, key: str, data: bytes) -> None:
        """Put the file on its keepers. A keeper that fails the put was lost meanwhile, or is a
        handle this process kept of a keeper since replaced under the same name: forget the
        handles and place the file once more among the keepers live now."""
        ref = ray.put(data)  # one copy in the object store, pulled by both keepers
        for attempt in (1, 2):
            targets = self._targets()
            try:
                ray.get([h.put.remote(key, ref) for h in targets.values()], timeout=CALL_TIMEOUT_S)
                return
            except GetTimeoutError as e:
                _forget(self.run_key, targets)
                raise OSError(
                    f"{self._where(key)}: not stored: a keeper on nodes {sorted(targets)} did "
                    f"not answer within {CALL_TIMEOUT_S:.0f} s"
                ) from e
            except RayActorError as e:
                _forget(self.run_key, targets)
                if attempt == 2:
                    raise OSError(
                        f"{self._where(key)}: not stored: a keeper failed the put on both tries, "
                        f"the second time one of nodes {sorted(targets)} ({e})"
                    ) from e

    def _holders(self, key: str) -> tuple[list[tuple[str, ActorHandle]], int]:
        """(node, keeper) of every live keeper holding the file `key`, home first, and its size
        ([] and 0 when none does)."""
        found = keepers(self.run_key)
        sizes = {
            n: held[key]
            for n, held in self._ask("info", [key], among=found).items()
            if held.get(key) is not None
        }
        order = sorted(sizes, key=lambda n: (n != self.home, n))
        return [(n, found[n]) for n in order], sizes[order[0]] if order else 0

    # ------------------------------------------------------------------ info

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        keys = [_key(p) for p in paths]
        found: dict[str, Optional[int]] = {}
        for held in self._ask("info", [k for k in keys if k]).values():
            for k, size in held.items():
                if size is not None or k not in found:
                    found[k] = size
        out = []
        for p, k in zip(paths, keys):
            if not k or (k in found and found[k] is None):
                out.append(pafs.FileInfo(p, pafs.FileType.Directory))
            elif k in found:
                out.append(pafs.FileInfo(p, pafs.FileType.File, size=found[k]))
            else:
                out.append(pafs.FileInfo(p, pafs.FileType.NotFound))
        return out

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        base = _key(selector.base_dir)
        prefix = f"{base}/" if base else ""
        files: dict[str, int] = {}
        for listing in self._ask("list", prefix).values():
            files.update(listing)
        if not files:
            info = self.get_file_info([selector.base_dir])[0]
            if info.type == pafs.FileType.File:
                raise NotADirectoryError(f"{self._where(base)}: not a directory")
            if selector.allow_not_found or not base:
                return []
            raise FileNotFoundError(f"{self._where(base)}: no such directory")
        lead = selector.base_dir.rstrip("/")
        lead = f"{lead}/" if lead or selector.base_dir.startswith("/") else ""
        entries: dict[str, Optional[int]] = {}  # relative path -> size; None for a directory
        for path, size in files.items():
            parts = path[len(prefix) :].split("/")
            for i in range(1, (len(parts) if selector.recursive else 1) + 1):
                rel = "/".join(parts[:i])
                entries[rel] = size if i == len(parts) else None
        return [
            pafs.FileInfo(lead + rel, pafs.FileType.Directory)
            if size is None
            else pafs.FileInfo(lead + rel, pafs.FileType.File, size=size)
            for rel, size in sorted(entries.items())
        ]

    # ------------------------------------------------------------------ changes

    def create_dir(self, path: str, recursive: bool) -> None:
        """Nothing to do: a directory exists while a file lies under it."""

    def delete_dir(self, path: str) -> None:
        key = _key(path)
        if not key:
            raise OSError(f"{self._where('')}: refusing to delete the root (delete its contents)")
        if not sum(self._ask("delete_prefix", f"{key}/").values()):
            raise FileNotFoundError(f"{self._where(key)}: no such directory")

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        key = _key(path)
        deleted = sum(self._ask("delete_prefix", f"{key}/" if key else "").values())
        if key and not deleted and not missing_dir_ok:
            raise FileNotFoundError(f"{self._where(key)}: no such directory")

    def delete_root_dir_contents(self) -> None:
        self._ask("delete_prefix", "")

    def delete_file(self, path: str) -> None:
        key = _key(path)
        if not any(self._ask("delete", key).values()):
            raise FileNotFoundError(f"{self._where(key)}: no such file")

    def move(self, src: str, dest: str) -> None:
        """Renamed on every keeper holding it: the copies stay where they were placed."""
        if not sum(self._ask("move", _key(src), _key(dest)).values()):
            raise FileNotFoundError(f"{self._where(_key(src))}: no such file or directory")

    def copy_file(self, src: str, dest: str) -> None:
        """Placed like any file this process writes (home and peer), wherever `src` is."""
        with self.open_input_stream(src) as f:
            data = f.read()
        self._store(_key(dest), data)

    # ------------------------------------------------------------------ streams

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.open_input_file(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        key = _key(path)
        holders, size = self._holders(key)
        if not holders:
            raise FileNotFoundError(f"{self._where(key)}: no such file on any live keeper")
        return pa.PythonFile(_RangeReader(key, size, holders, self._where(key)), mode="r")

    def open_output_stream(self, path: str, metadata=None) -> pa.NativeFile:
        """To its two keepers: whole on close, or in parts of PART_BYTES (_Upload)."""
        return pa.PythonFile(_Upload(self, _key(path)), mode="w")

    def open_append_stream(self, path: str, metadata=None) -> pa.NativeFile:
        raise OSError(
            f"{self._where(_key(path))}: keeper files cannot be appended to; they are written "
            "whole (open_output_stream)"
        )


PART_BYTES = 64 * 2**20
"""A file written through the keeper filesystem is sent in parts of this size as it is written
(a shard's data file is GBs at 8B): the writer holds at most one part in its buffer and one in
the object store, instead of the whole file twice. A smaller file goes whole."""


class _Upload(io.RawIOBase):
    """An output stream. A file up to PART_BYTES goes to its keepers whole on close (`_store`,
    which places it again if a keeper is lost meanwhile); a larger one in parts as it is
    written, one part in flight, and is committed on close: a reader sees either no file or all
    of it. A keeper lost during a parted upload fails the file (its earlier parts are gone from
    this process): the snapshot fails, and the next one is placed among the keepers left."""

    def __init__(self, fs: KeeperFileSystem, key: str):
        super().__init__()
        self._fs, self._key = fs, key
        self._buf = bytearray()
        self._written = 0
        self._parts = 0
        self._targets: Optional[dict[str, ActorHandle]] = None
        self._in_flight: list = []

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, data) -> int:
        n = len(data)
        self._buf += data
        self._written += n
        while len(self._buf) >= PART_BYTES:
            part = bytes(self._buf[:PART_BYTES])
            del self._buf[:PART_BYTES]
            self._send(part)
        return n

    def _send(self, part: bytes) -> None:
        if self._targets is None:
            self._targets = self._fs._targets()
        self._wait()
        ref = ray.put(part)
        self._in_flight = [
            h.put_part.remote(self._key, self._parts, ref) for h in self._targets.values()
        ]
        self._parts += 1

    def _wait(self, calls: Optional[list] = None) -> None:
        calls, self._in_flight = (self._in_flight if calls is None else calls), []
        if not calls:
            return
        try:
            ray.get(calls, timeout=CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            _forget(self._fs.run_key, self._targets or ())
            raise OSError(
                f"{self._fs._where(self._key)}: not stored: a keeper on nodes "
                f"{sorted(self._targets or ())} was lost or did not answer during the upload "
                f"of part {self._parts} ({type(e).__name__})"
            ) from e

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._parts == 0:
                self._fs._store(self._key, bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                self._wait()
                self._wait(
                    [h.commit.remote(self._key, self._parts) for h in self._targets.values()]
                )
        finally:
            self._buf = bytearray()
            super().close()


class _RangeReader(io.RawIOBase):
    """A seekable input file whose reads fetch just the range asked for from a keeper holding
    it; when that keeper is gone the next one is asked (its node's loss must not fail a read
    that another copy can serve)."""

    def __init__(self, key: str, size: int, holders: list[tuple[str, ActorHandle]], where: str):
        super().__init__()
        self._key, self._size, self._holders, self._where = key, size, list(holders), where
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(f"{self._where}: seek to {base + offset}; valid: a position >= 0")
        self._pos = base + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:
        n = self._size - self._pos if size is None or size < 0 else size
        n = max(0, min(n, self._size - self._pos))
        data = self._fetch(self._pos, n) if n else b""
        self._pos += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        memoryview(buf).cast("B")[: len(data)] = data
        return len(data)

    def _fetch(self, offset: int, length: int) -> bytes:
        while self._holders:
            _, handle = self._holders[0]
            try:
                data = ray.get(
                    handle.read.remote(self._key, offset, length), timeout=CALL_TIMEOUT_S
                )
            except (RayActorError, GetTimeoutError):
                data = None
            if data is not None:
                return data
            self._holders.pop(0)  # dead, or the file was deleted there since it was opened
        raise OSError(f"{self._where}: no live keeper holds it any more (lost with its nodes)")
