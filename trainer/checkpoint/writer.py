"""CheckpointWriter: the training loop's handle for saving, one per rank.

    writer = CheckpointWriter("s3://bucket/run/checkpoints", keep=3, group=pg)
    writer.save(step, rank, world, chunks, state)   # returns once chunks are on the host
    ...
    writer.close()                                  # waits, re-raises a failed save

The order of one save, on every rank: copy chunks to the host (the loop waits only for this) ->
[background] write shard file + index -> barrier -> rank 0: commit (manifest last) -> retention.
A rank whose write failed still enters the barrier, so the others never hang on it; rank 0 then
finds its index missing and does not commit.

The barrier runs on `group`, a process group of its own (gloo, so it never interleaves with the
training's collectives: it runs on the writer's background thread). Tests that simulate ranks as
threads in one process pass a `barrier` callable to `save` instead.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from trainer import storage
from trainer.checkpoint import shard
from trainer.checkpoint.commit import commit
from trainer.checkpoint.format import (
    BLOCK_BYTES,
    MAX_BLOCK_BYTES,
    CheckpointError,
    TensorChunk,
    step_dir_name,
)
from trainer.checkpoint.retention import apply_retention, normalize
from trainer.storage import Location

log = logging.getLogger(__name__)


class CheckpointWriter:
    def __init__(
        self,
        root: str,
        keep: int = 3,
        async_save: bool = True,
        filesystem: Optional[pafs.FileSystem] = None,
        block_bytes: int = BLOCK_BYTES,
        group: Optional[dist.ProcessGroup] = None,
        retention_log_level: int = logging.INFO,
        check_finite: bool = False,
        commit_guard: Optional[Callable[[], Optional[str]]] = None,
    ):
        """`root`: a local path or a pyarrow.fs URI (or a path inside `filesystem`); checkpoints
        go to f"{root}/step_{step:09d}". `keep`: committed checkpoints kept by rank 0.
        `block_bytes`: checksum block size (tests use small blocks). `group`: the process group
        whose ranks save together (their barrier precedes the commit); None with one rank.
        `check_finite`: refuse a state with a NaN or an infinity in a floating-point chunk,
        checked on the host copy on the writer's thread (the snapshots': the durable save checks
        on the device first); that rank writes nothing, so rank 0's commit fails and the
        previous checkpoint stays the newest. `commit_guard()`: asked by rank 0 right before it
        commits: None to go on, else why this writer may no longer write (the run was taken
        over); nothing is committed or deleted then."""
        if keep < 1:
            raise CheckpointError(f"CheckpointWriter keep={keep!r}; valid: an integer >= 1")
        if block_bytes <= 0 or block_bytes % 8 or block_bytes > MAX_BLOCK_BYTES:
            raise CheckpointError(
                f"CheckpointWriter block_bytes={block_bytes!r}; valid: a positive multiple of 8, "
                f"at most {MAX_BLOCK_BYTES} (readers refuse larger checksum blocks)"
            )
        self.root: Location = storage.resolve(root, filesystem)
        self._filesystem = filesystem
        self._group = group
        self.keep, self.async_save, self.block_bytes = keep, async_save, block_bytes
        self.retention_log_level = retention_log_level
        self.check_finite = check_finite
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="ckpt-save") if async_save else None
        )
        self._pending: Optional[tuple[Future, str]] = None
        self._last_path: Optional[str] = None
        self._protected: set[str] = set()
        self._staging: Optional[torch.Tensor] = None
        self._closed = False
        self._commit_guard = commit_guard

    # ------------------------------------------------------------------ public

    def save(
        self,
        step: int,
        rank: int,
        world_size: int,
        chunks: list[TensorChunk],
        state: dict,
        barrier: Optional[Callable[[], None]] = None,
    ) -> None:
        """Save this rank's chunks of checkpoint `step`; see the module docstring for the order.

        Blocks until the previous save finished (re-raising its failure) and the chunks are
        copied to host memory. `state` (JSON-able) is taken from rank 0 into the manifest.
        `barrier`: how the ranks meet before the commit; default: a barrier on `group`.
        """
        if self._closed:
            raise CheckpointError("CheckpointWriter.save() after close()")
        self.wait()
        step_dir = self._check_args(step, rank, world_size, chunks)
        state_copy = _json_copy(state)
        placements, total = shard.plan(chunks)
        self._staging = shard.stage(chunks, placements, total, self._staging)
        desc = f"step {step} (rank {rank} of {world_size}) to {step_dir}"
        barrier = barrier or self._group_barrier(world_size)
        job = (
            step_dir,
            step,
            rank,
            world_size,
            placements,
            total,
            self._staging,
            state_copy,
            barrier,
        )
        if self._executor is None:
            self._last_path = _reraise(desc, lambda: self._write(*job))
            return
        fut = self._executor.submit(self._write, *job)
        fut.add_done_callback(lambda f: _log_failure(desc, f))
        self._pending = (fut, desc)

    def wait(self) -> Optional[str]:
        """Wait for the save in flight; return the path of the last save (committed when this
        is rank 0). Re-raises a failure of the background save, once."""
        pending, self._pending = self._pending, None
        if pending is not None:
            fut, desc = pending
            self._last_path = _reraise(desc, fut.result)
        return self._last_path

    def in_flight(self) -> bool:
        """A save was started and has not finished on this rank (never blocks)."""
        return self._pending is not None and not self._pending[0].done()

    def protect(self, path: str) -> None:
        """Never delete this checkpoint (the one the run resumed from), nor save over it."""
        self._protected.add(normalize(path, self._filesystem))

    def close(self) -> None:
        """Wait for the last save (re-raising its failure) and stop the background thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _group_barrier(self, world_size: int) -> Callable[[], None]:
        if world_size == 1:
            return lambda: None
        if self._group is None:
            raise CheckpointError(
                f"CheckpointWriter: {world_size} ranks save together but no "
                "process group was given (group=...)"
            )
        group = self._group
        return lambda: dist.barrier(group=group)

    def _check_args(self, step, rank, world_size, chunks) -> Location:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"save step={step!r}; valid: an integer >= 0")
        if not isinstance(world_size, int) or world_size < 1:
            raise CheckpointError(f"save world_size={world_size!r}; valid: an integer >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise CheckpointError(f"save rank={rank!r}; valid: 0 <= rank < world_size={world_size}")
        shard.validate_chunks(chunks)
        step_dir = self.root.child(step_dir_name(step))
        if step_dir.path in self._protected:
            raise CheckpointError(
                f"refusing to save step {step} over {step_dir}: it is the "
                "protected checkpoint this run resumed from"
            )
        return step_dir

    def _write(
        self, step_dir, step, rank, world_size, placements, total, staging, state, barrier
    ) -> str:
        error = None
        try:
            if self.check_finite:
                bad = shard.nonfinite_chunks(staging, placements)
                if bad:
                    more = ", ..." if len(bad) > 3 else ""
                    raise CheckpointError(
                        f"not saving step {step}: rank {rank}'s state is not finite in "
                        f"{len(bad)} tensor(s): {', '.join(bad[:3])}{more}"
                    )
            shard.write_shard(
                step_dir, step, rank, world_size, placements, total, staging, self.block_bytes
            )
        except BaseException as e:  # still enter the barrier: the other ranks wait for us
            error = e
        barrier()
        if error is not None:
            raise error
        if rank == 0:
            reason = self._commit_guard() if self._commit_guard is not None else None
            if reason:
                raise CheckpointError(f"not committing {step_dir}: {reason}")
            commit(step_dir, step, world_size, state)
            self._retain(step)
        return str(step_dir)

    def _retain(self, step: int) -> None:
        # The checkpoint is committed: a failure to delete old ones must not fail the save.
        try:
            apply_retention(self.root, self.keep, step, self._protected, self.retention_log_level)
        except OSError as e:
            log.warning(
                "checkpoint retention under %s failed (nothing committed is lost): %s", self.root, e
            )


def _reraise(desc: str, fn: Callable[[], str]) -> str:
    try:
        return fn()
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint save of {desc} failed: {e}") from e
    except Exception as e:
        raise CheckpointError(f"checkpoint save of {desc} failed: {type(e).__name__}: {e}") from e


def _log_failure(desc: str, fut: Future) -> None:
    """Log a failure as soon as it happens; the next save()/wait()/close() raises it too."""
    if fut.exception() is not None:
        log.error("background checkpoint save of %s failed: %s", desc, fut.exception())


def _json_copy(state: dict) -> dict:
    """A deep copy through JSON, so the manifest can hold it and later mutations do not leak."""
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint state must be JSON-able (encode tensors/bytes, e.g. "
            f"RNG states, as base64 strings): {e}"
        ) from e
