"""The run folder's elastic/ documents: small JSON files the elastic parts share across
worker-group starts, and with the driver.

The run folder is Ray Train's, <cluster.storage_path>/<cluster.run_name> (its layout:
cluster/run/layout.py); its elastic/ folder holds, each written by the module named:

    fault.json                the fired fault drill: kind, rank, step, time (elastic/faults.py)
    drain_request.json        the controller's drain request before a grow (elastic/grow.py)
    drain_ack.json            rank 0's answer once the drain's checkpoint committed (the same)
    controller_clock.json     the controller's times of the last group start (elastic/clock.py)
    attempts/<start ns>.json  one worker-group start: launch, world size, start step, progress
                              (last step trained and when), recovery figures (elastic/tracker.py)
    fatal.json                the error that ended a launch's training for good (run/fatal.py)

A document is replaced whole, never torn.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from cluster.config import ClusterConfig
from cluster.run.layout import ELASTIC_DIR, ray_run_folder, run_folder
from trainer.storage import Location, list_dir, read_bytes, resolve, write_atomic


class RunFolder:
    """Small JSON documents under one folder of a pyarrow filesystem; unreadable ones read as
    None."""

    def __init__(self, location: Location):
        self.location = location

    @classmethod
    def of_ray_run(cls, storage) -> "RunFolder":
        """The elastic/ folder of the run, as a worker finds it (Ray's storage context)."""
        return cls(ray_run_folder(storage).child(ELASTIC_DIR))

    @classmethod
    def of_run(cls, cluster: ClusterConfig) -> "RunFolder":
        """The elastic/ folder of the run, as the driver finds it (the job's config)."""
        return cls.at(run_folder(cluster.storage_path, cluster.run_name, ELASTIC_DIR))

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
