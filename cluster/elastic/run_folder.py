"""The run folder: small JSON documents the elastic parts share across worker-group starts.

Ray Train's run folder (<storage_path>/<run_name>, a local path or any pyarrow filesystem) holds
an elastic/ folder: the fired fault drill (cluster/elastic/faults.py) and one record per
worker-group start (cluster/elastic/tracker.py). A document is replaced whole, never torn.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from trainer.storage import Location, list_dir, read_bytes, resolve, write_atomic

ELASTIC_DIR = "elastic"


class RunFolder:
    """Small JSON documents under one folder of a pyarrow filesystem; unreadable ones read as
    None."""

    def __init__(self, location: Location):
        self.location = location

    @classmethod
    def of_ray_run(cls, storage) -> "RunFolder":
        """The elastic/ folder of Ray Train's run folder (ray.train.get_context().get_storage())."""
        return cls(
            resolve(f"{storage.experiment_fs_path}/{ELASTIC_DIR}", storage.storage_filesystem)
        )

    @classmethod
    def at(cls, path_or_uri: str) -> "RunFolder":
        return cls(resolve(path_or_uri))

    def read(self, name: str) -> Optional[dict]:
        try:
            return json.loads(read_bytes(self.location.child(name)))
        except (FileNotFoundError, ValueError):
            return None

    def write(self, name: str, doc: dict, durable: bool = False) -> None:
        """Readers see the old or the new document, never a torn one (tmp + rename on local disks,
        one PUT on object stores). `durable` also fsyncs: for what must survive an os._exit."""
        loc = self.location.child(name)
        self.location.fs.create_dir(loc.path.rsplit("/", 1)[0], recursive=True)
        data = json.dumps(doc, sort_keys=True).encode()
        if durable or not loc.is_local:
            write_atomic(loc, data)
            return
        tmp = f"{loc.path}.tmp-{uuid.uuid4().hex}"
        with loc.fs.open_output_stream(tmp, compression=None) as f:
            f.write(data)
        loc.fs.move(tmp, loc.path)

    @property
    def is_local(self) -> bool:
        return self.location.is_local

    def exists(self, name: str) -> bool:
        return name in list_dir(self.location)

    def names(self, subdir: str) -> list[str]:
        """Sorted names ('subdir/x.json') of the JSON documents in `subdir`, temporaries left
        out."""
        names = list_dir(self.location.child(subdir))
        return sorted(f"{subdir}/{n}" for n in names if n.endswith(".json"))
