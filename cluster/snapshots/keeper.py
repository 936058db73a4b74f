"""One node's share of a run's in-memory snapshots: a Ray actor holding files in its memory.

Its own module, importing nothing of the project: a keeper process imports only this (Ray loads
an actor's class by module), not the filesystem, Ray Train and the project behind it (2.3 s and
their memory, per keeper). Naming and lifetime: keepers.py; placement and the filesystem on
top: keeper_fs.py.
"""

from __future__ import annotations

from typing import Optional

import ray


class SnapshotKeeper:
    """One node's share of one run's snapshots: path -> bytes, in this process's memory.

    Paths are KeeperFileSystem's keys ('snapshots/step_000000001/manifest.json': no leading or
    trailing slash). Nothing here knows about placement or checkpoints.

    A file arrives whole (`put`) or in parts (`put_part` 0, 1, ..., then `commit`), so that the
    writer never holds a multi-GB file twice; it is kept as its parts, and is visible to reads
    and listings only once committed (an upload its writer abandoned is dropped with its
    directory, or replaced by the next upload of the path).
    """

    def __init__(self):
        self._files: dict[str, list[bytes]] = {}
        self._uploads: dict[str, list[bytes]] = {}

    def put(self, path: str, data: bytes) -> None:
        self._uploads.pop(path, None)
        self._files[path] = [data]

    def put_part(self, path: str, index: int, data: bytes) -> None:
        """Part `index` of an upload of `path`; part 0 starts the upload anew."""
        if index == 0:
            self._uploads[path] = []
        parts = self._uploads.get(path)
        if parts is None or len(parts) != index:
            raise ValueError(
                f"{path}: part {index} out of order (have {None if parts is None else len(parts)})"
            )
        parts.append(data)

    def commit(self, path: str, parts: int) -> int:
        """Make the upload of `path` (`parts` parts) the file; returns its size."""
        got = self._uploads.get(path)
        if got is None or len(got) != parts:
            raise ValueError(
                f"{path}: commit of {parts} parts, but {None if got is None else len(got)} came"
            )
        self._files[path] = self._uploads.pop(path)
        return _size(self._files[path])

    def read(self, path: str, offset: int, length: int) -> Optional[bytes]:
        """Bytes [offset, offset + length) of the file (fewer at its end); None if not held."""
        parts = self._files.get(path)
        if parts is None:
            return None
        if len(parts) == 1:
            return parts[0][offset : offset + length]
        out, start, end = [], offset, offset + length
        for part in parts:
            if start < len(part) and end > 0:
                out.append(part[max(start, 0) : end])
            start, end = start - len(part), end - len(part)
            if end <= 0:
                break
        return b"".join(out)

    def info(self, paths: list[str]) -> dict[str, Optional[int]]:
        """For each path held: its size if it is a file, None if files lie under it (a
        directory). Paths neither are left out."""
        out: dict[str, Optional[int]] = {}
        for p in paths:
            if p in self._files:
                out[p] = _size(self._files[p])
            elif any(k.startswith(f"{p}/") for k in self._files):
                out[p] = None
        return out

    def list(self, prefix: str) -> dict[str, int]:
        """{path: size} of every file whose path starts with `prefix`."""
        return {p: _size(d) for p, d in self._files.items() if p.startswith(prefix)}

    def delete(self, path: str) -> bool:
        self._uploads.pop(path, None)
        return self._files.pop(path, None) is not None

    def delete_prefix(self, prefix: str) -> int:
        for p in [p for p in self._uploads if p.startswith(prefix)]:
            del self._uploads[p]
        doomed = [p for p in self._files if p.startswith(prefix)]
        for p in doomed:
            del self._files[p]
        return len(doomed)

    def move(self, src: str, dst: str) -> int:
        """Rename the file `src`, or every file under the directory `src`; files moved."""
        if src in self._files:
            self._files[dst] = self._files.pop(src)
            return 1
        moved = [p for p in self._files if p.startswith(f"{src}/")]
        for p in moved:
            self._files[dst + p[len(src) :]] = self._files.pop(p)
        return len(moved)

    def bytes_held(self) -> int:
        """Committed files and uploads in progress."""
        return sum(_size(d) for d in (*self._files.values(), *self._uploads.values()))

    def node_id(self) -> str:
        """The node this keeper runs on (tests check the pinning with it)."""
        return ray.get_runtime_context().get_node_id()


def _size(parts: list[bytes]) -> int:
    return sum(len(p) for p in parts)
