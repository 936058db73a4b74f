"""Telling Ray Train about a checkpoint the loop has already written, without copying it.

The loop writes sharded checkpoints into `<storage>/<run>/checkpoints/` and prunes old ones itself.
Ray Train V2 keeps its own list of reported checkpoints (checkpoint_manager_snapshot.json in the
run folder); when a run is resubmitted it refuses to start if any listed checkpoint is gone, and
with CheckpointConfig(num_to_keep) it deletes old ones itself. Reporting the loop's folders
directly would make Ray and the loop delete the same folders. So each report registers a tiny
pointer folder owned by Ray (`<storage>/<run>/ray_checkpoints/step_<s>_<n>/pointer.json` naming
the real checkpoint), with CheckpointUploadMode.NO_UPLOAD: already in Ray's run folder, nothing
is copied. Ray prunes pointers, the loop prunes checkpoints, neither touches the other's files.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from cluster.run.layout import POINTER_DIR

POINTER_FILE = "pointer.json"


def pointer_dir_name(step: int) -> str:
    """Unique per report (a step can be saved twice, e.g. by a resubmitted finished run)."""
    return f"{POINTER_DIR}/step_{step:08d}_{time.time_ns()}"


def report_checkpoint(checkpoint_path: str, step: int) -> None:
    """WorkerContext.on_checkpoint under Ray: called on every rank (ray.train.report is a barrier).

    Rank 0 writes the pointer and registers it; the other ranks report no checkpoint, which
    Ray merges into rank 0's (its dir name is broadcast from rank 0).
    """
    import ray.train  # noqa: PLC0415 -- ray costs seconds to import; the driver imports this
    from ray.train import Checkpoint, CheckpointUploadMode  # noqa: PLC0415 -- the same

    context = ray.train.get_context()
    checkpoint, name = None, None
    if context.get_world_rank() == 0:
        storage = context.get_storage()
        name = pointer_dir_name(step)
        fs_path = f"{storage.experiment_fs_path}/{name}"
        write_pointer(storage.storage_filesystem, fs_path, checkpoint_path, step)
        checkpoint = Checkpoint(path=fs_path, filesystem=storage.storage_filesystem)
    ray.train.report(
        {"step": step, "checkpoint_path": checkpoint_path},
        checkpoint=checkpoint,
        checkpoint_dir_name=name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )


def write_pointer(filesystem, fs_path: str, checkpoint_path: str, step: int) -> None:
    filesystem.create_dir(fs_path)
    body = json.dumps({"checkpoint": checkpoint_path, "step": step}).encode()
    with filesystem.open_output_stream(f"{fs_path}/{POINTER_FILE}") as f:
        f.write(body)


def read_pointer(checkpoint) -> Optional[dict]:
    """{'checkpoint': path, 'step': s} of a Ray Checkpoint written by report_checkpoint, else
    None."""
    if checkpoint is None:
        return None
    try:
        with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{POINTER_FILE}") as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return None
