"""The run folder's layout: every path this project keeps in <storage_path>/<run_name>.

    run_folder("runs", "r1")                        # 'runs/r1': Ray Train's run folder
    checkpoint_root("s3://b/runs?region=x", "r1")   # 's3://b/runs/r1/checkpoints?region=x'
    ray_run_folder(ray.train.get_context().get_storage())   # the same folder, in a worker

The ground floor of cluster/ with config.py: it imports nothing of cluster/ (config.py takes
JobConfig.checkpoint_root from here), and every module that reads or writes the run folder takes
its paths from here.
"""

from __future__ import annotations

from trainer.storage import Location, resolve

CHECKPOINTS_DIR = "checkpoints"
POINTER_DIR = "ray_checkpoints"
LEASE_DIR = "lease"
ELASTIC_DIR = "elastic"


def run_folder(storage_path: str, run_name: str, *below: str) -> str:
    """<storage_path>/<run_name>[/below...]: Ray Train's run folder (or a path in it), a local
    path or a pyarrow.fs URI, whose query string (an S3 endpoint's options) stays at the end.
    Ray keeps its own state there (checkpoint_manager_snapshot.json); what this project keeps
    there is named here, and only here:

        checkpoints/       CHECKPOINTS_DIR: the loop's sharded checkpoints (trainer/checkpoint)
        ray_checkpoints/   POINTER_DIR: one pointer folder per checkpoint reported to Ray
                           (cluster/run/ray_checkpoint.py)
        lease/             LEASE_DIR: the run lease's generation files (cluster/run/lease.py)
        elastic/           ELASTIC_DIR: small JSON documents shared across worker-group starts
                           (cluster/run/folder.py RunFolder lists them)
    """
    base, sep, query = storage_path.partition("?")
    return "/".join([base.rstrip("/"), run_name, *below]) + sep + query


def checkpoint_root(storage_path: str, run_name: str) -> str:
    """<storage_path>/<run_name>/checkpoints: a run's checkpoints, in Ray's run folder."""
    return run_folder(storage_path, run_name, CHECKPOINTS_DIR)


def ray_run_folder(storage) -> Location:
    """The run folder as Ray Train's context in a worker has it
    (ray.train.get_context().get_storage(): a StorageContext)."""
    return resolve(storage.experiment_fs_path, storage.storage_filesystem)
