"""In-memory snapshots between durable checkpoints (DESIGN.md invariant 5): the checkpoint
format, written by a writer of their own to the peers' memory (the cluster layer's keeper://
filesystem), two generations kept. The Checkpointer takes one at the steps
`due` says, and offers the newer complete ones first at resume.

    snaps = Snapshots.of_launch(storage, cfg.train, world_size, log)   # None: snapshots off
    if snaps.due(step, busy): snaps.save(step, state, chunks, rank)
    paths = snaps.newer_than(durable_step, rank, control)   # resume: newest first

A launch may also inherit a root: the snapshots of the run's previous launch, which died without
ending (its driver killed) while its keepers still hold them. Resume offers those too, newest
first among both, and never writes there; the Checkpointer calls its release_inherited once this
launch's own first snapshot or durable checkpoint is committed, so the inherited ones are freed.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

from trainer.checkpoint import CheckpointWriter, TensorChunk, list_checkpoints
from trainer.checkpoint.launch_storage import LaunchStorage
from trainer.checkpoint.trainer_state import TrainerState
from trainer.config import TrainConfig


class Snapshots:
    """In-memory snapshots: the checkpoint format, written to `root` (the launcher's peers'
    memory: the cluster layer's keeper://), two generations kept.

    A snapshot is a checkpoint of its own writer (its own gloo barrier group: created on every
    rank, in the same order), asynchronous like the durable one: the loop waits only for the
    copy of its shard state to host memory; sending it on happens on the writer's thread.
    `every`: None -> at every step where the previous snapshot has been sent (all ranks agree:
    the busy flag is all-reduced), so the copy always hides behind compute; N -> every N steps
    (waiting for the previous one if it is still being sent). A snapshot that fails (a keeper
    gone with its node) is reported and the next one is tried: snapshots never stop training.
    Resuming, `newer_than` offers the complete snapshots newer than the newest durable
    checkpoint, newest first, as rank 0 lists them (all ranks try the same ones, in order),
    from `root` and from `inherited` (a previous launch's root, read only), if given."""

    KEEP = 2

    def __init__(
        self,
        root: str,
        every: Optional[int],
        world_size: int,
        log=print,
        inherited: Optional[str] = None,
    ):
        self.root, self.every, self.log = root, every, log
        self.inherited = inherited if inherited and inherited != root else None
        group = dist.new_group(backend="gloo") if world_size > 1 else None
        if group is not None:  # gloo connects a group at its first collective: not mid-snapshot
            dist.barrier(group=group)
        self.writer = CheckpointWriter(
            root,
            keep=self.KEEP,
            async_save=True,
            group=group,
            retention_log_level=logging.DEBUG,
            check_finite=True,  # on the host copy, on the writer's thread: no device sync
        )
        self.world = world_size
        self._in_flight: Optional[int] = None
        self.last_step: Optional[int] = None
        self.blocked_ms: Optional[float] = None
        self.bytes: int = 0
        self.taken = 0  # snapshots started by this rank

    @classmethod
    def of_launch(
        cls, storage: LaunchStorage, train: TrainConfig, world_size: int, log=print
    ) -> Optional["Snapshots"]:
        """The launch's snapshots: where its launcher keeps them, as often as
        train.snapshot_every says; None when it takes none (LaunchStorage.snapshots_on)."""
        if not storage.snapshots_on(train):
            return None
        root, inherited = storage.snapshot_root, storage.inherited_snapshots
        return cls(root, train.snapshot_every, world_size, log, inherited)

    def due(self, step: int, busy: bool) -> bool:
        if self.every is None:
            if busy:
                return False
        elif step % self.every:
            return False
        self._collect()
        return True

    def save(self, step: int, state: TrainerState, chunks: list[TensorChunk], rank: int) -> None:
        self.writer.save(step, rank, self.world, chunks, state.to_json())
        self.bytes = sum(c.data.numel() * c.data.element_size() for c in chunks)
        self._in_flight = step
        self.taken += 1

    def _collect(self) -> None:
        """The previous snapshot's outcome (it is done or being waited for)."""
        if self._in_flight is None:
            return
        step, self._in_flight = self._in_flight, None
        try:
            self.writer.wait()
            self.last_step = step
        except Exception as e:  # a keeper gone: the next snapshot is tried
            self.log(f"snapshot of step {step} failed ({type(e).__name__}: {e}); trying again")

    def metrics(self) -> dict[str, float]:
        """snapshot/step (the newest sent), snapshot/blocked_ms (the training thread's wait at
        the last step: agreeing whether one is due, and the copy to host memory when it was),
        mem/snapshot_bytes (this rank's shard state in
        one snapshot; the keepers hold 2 copies x 2 generations of it)."""
        m = {"mem/snapshot_bytes": float(self.bytes)} if self.bytes else {}
        if self.last_step is not None:
            m["snapshot/step"] = float(self.last_step)
        if self.blocked_ms is not None:
            m["snapshot/blocked_ms"] = self.blocked_ms
        return m

    def holds(self, path: str) -> bool:
        """`path` is a snapshot (of this launch's or the inherited root), not a durable one."""
        roots = [self.root] + ([self.inherited] if self.inherited else [])
        return any(path.startswith(r.rstrip("/") + "/") for r in roots)

    def newer_than(self, durable_step: int, rank: int, control) -> list[str]:
        """Complete snapshots newer than `durable_step`, newest first, as rank 0 sees them:
        this launch's and the inherited root's (this launch's first at equal steps)."""
        paths: list = [None]
        if rank == 0:
            infos = []
            for root in [self.root] + ([self.inherited] if self.inherited else []):
                try:
                    infos += list_checkpoints(root)
                except Exception as e:  # the keepers unreachable: the durable checkpoint it is
                    self.log(f"snapshots: cannot list {root} ({type(e).__name__}: {e})")
            infos.sort(key=lambda i: i.step, reverse=True)  # stable: this launch's first
            newer = [i for i in infos if i.step > durable_step]
            good = [i.path for i in newer if not i.problem]
            for i in newer:
                if i.problem:
                    self.log(f"snapshot of step {i.step} is incomplete: {i.problem}")
            if newer and not good:
                self.log(
                    "no complete in-memory snapshot newer than the durable checkpoint of step "
                    f"{durable_step}: resuming from that checkpoint"
                )
            paths = [good]
        if self.world > 1:
            dist.broadcast_object_list(paths, src=0, group=control)
        return paths[0]

    def close(self) -> None:
        try:
            self._collect()
        finally:
            self.writer.close()
