"""Where one launch of a run reads and writes its state: one value the launcher hands over.

    storage = LaunchStorage(root="runs/r/checkpoints", snapshot_root="keeper://r-1a2b/snapshots")
    ckpt = Checkpointer(cfg, storage, model, optimizer, scaler, rank=r, world_size=w, device=d)

The launcher (cluster/worker.py under Ray; a test under torch.multiprocessing) decides where the
checkpoints and the snapshots live, what an older launch left to resume from, who hears of a
commit and whether this launch may still write; trainer.loop.WorkerContext.storage builds this
value from its fields. The Checkpointer reads it and derives nothing else from the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from trainer.config import TrainConfig


@dataclass(frozen=True)
class LaunchStorage:
    """Where a launch reads and writes: its checkpoints, its snapshots, an older launch's."""

    root: str
    """This run's checkpoint folder (a path or pyarrow.fs URI)."""
    resume_from: Optional[str] = None
    """A checkpoint to resume from instead of the newest valid one under root."""
    snapshot_root: Optional[str] = None
    """Where in-memory snapshots go (trainer/checkpoint/snapshots.py; a pyarrow.fs URI, e.g. the
    cluster layer's keeper:// on peers' memory), or None: none."""
    inherited_snapshots: Optional[str] = None
    """A previous launch's snapshot root that resume also looks in (read only): that launch
    died without ending, and its snapshots may be newer than the durable checkpoint."""
    release_inherited: Optional[Callable[[], None]] = None
    """Called once, on the rank given it, when the inherited snapshots are not needed any more:
    this launch's own first snapshot or durable checkpoint is committed."""
    on_commit: Optional[Callable[[str, int], None]] = None
    """(checkpoint path, step), called on every rank once that step's checkpoint is committed
    (the cluster layer's report to Ray Train)."""
    may_write: Optional[Callable[[], Optional[str]]] = None
    """None while this launch may still write into the run's folder, else why not (the cluster
    layer's run lease, taken over by another launch)."""

    def snapshots_on(self, train: TrainConfig) -> bool:
        """Whether this launch takes in-memory snapshots: where the launcher gave a snapshot
        root, by the one rule (TrainConfig.snapshots_on). Giving a root is the launcher's
        decision that a snapshot's copy is worth its cost here (under Ray: on GPU workers, or
        with train.snapshot_every set: cluster.config.snapshots_on), so an unset cadence
        (null) means on; train.snapshot_every=0 still means none."""
        return bool(self.snapshot_root) and train.snapshots_on(gpu_workers=True)
