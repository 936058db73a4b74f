"""One node's share of a run's in-memory snapshots: a Ray actor holding files in its memory.

Its own module, importing nothing of the project: a keeper process imports only this (Ray loads
an actor's class by module), not cluster.elastic and Ray Train behind it (2.3 s and their
memory, per keeper). Placement, naming and the filesystem on top: cluster/elastic/snapshots.py.
"""

from __future__ import annotations

from typing import Optional

import ray


class SnapshotKeeper:
    """One node's share of one run's snapshots: path -> bytes, in this process's memory.

    Paths are KeeperFileSystem's keys ('snapshots/step_000000001/manifest.json': no leading or
    trailing slash). Nothing here knows about placement or checkpoints.
    """

    def __init__(self):
        self._files: dict[str, bytes] = {}

    def put(self, path: str, data: bytes) -> None:
        self._files[path] = data

    def read(self, path: str, offset: int, length: int) -> Optional[bytes]:
        """Bytes [offset, offset + length) of the file (fewer at its end); None if not held."""
        data = self._files.get(path)
        return None if data is None else data[offset : offset + length]

    def info(self, paths: list[str]) -> dict[str, Optional[int]]:
        """For each path held: its size if it is a file, None if files lie under it (a
        directory). Paths neither are left out."""
        out: dict[str, Optional[int]] = {}
        for p in paths:
            if p in self._files:
                out[p] = len(self._files[p])
            elif any(k.startswith(f"{p}/") for k in self._files):
                out[p] = None
        return out

    def list(self, prefix: str) -> dict[str, int]:
        """{path: size} of every file whose path starts with `prefix`."""
        return {p: len(d) for p, d in self._files.items() if p.startswith(prefix)}

    def delete(self, path: str) -> bool:
        return self._files.pop(path, None) is not None

    def delete_prefix(self, prefix: str) -> int:
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
        return sum(len(d) for d in self._files.values())

    def node_id(self) -> str:
        """The node this keeper runs on (tests check the pinning with it)."""
        return ray.get_runtime_context().get_node_id()
