"""Keep the newest K committed checkpoints; never delete a protected one (the one resumed from).

Runs on rank 0 right after a commit. "Committed" here is only "has a manifest" (one HEAD per
directory): retention must not read every checkpoint it keeps. Uncommitted directories older than
the step just committed are leftovers of torn saves and go too. Directories newer than the step
just committed belong to an abandoned timeline (a run that got further, then resumed from an
earlier checkpoint because a later one was torn or corrupt): they are neither counted nor
deleted, so the checkpoint just committed is always kept; a later save of that step replaces them.
"""

from __future__ import annotations

import logging
from typing import Optional

import pyarrow.fs as pafs

from trainer import storage
from trainer.checkpoint.catalog import step_dirs
from trainer.checkpoint.format import MANIFEST
from trainer.storage import Location

log = logging.getLogger(__name__)


def apply_retention(
    root: Location,
    keep: int,
    committed_step: int,
    protected: set[str],
    level: int = logging.INFO,
) -> list[str]:
    """Delete what falls outside the policy; return the deleted directories (each logged at
    `level`: in-memory snapshots, replaced every step, use DEBUG)."""
    deleted, kept = [], 0
    for step, loc in step_dirs(root.path, root.fs):
        if step > committed_step:
            continue
        committed = storage.exists(loc.child(MANIFEST))
        if committed and kept < keep:
            kept += 1
            continue
        if loc.path in protected or step == committed_step:
            continue
        # Display form rebuilt from the root so URIs keep their query string.
        display = root.child(loc.name)
        log.log(
            level,
            "checkpoint retention: deleting %s (%s)",
            display,
            "older than the newest %d" % keep if committed else "uncommitted leftover",
        )
        storage.delete_dir(loc)
        deleted.append(str(display))
    return deleted


def normalize(path: str, filesystem: Optional[pafs.FileSystem]) -> str:
    """The in-filesystem path of a step directory, for comparing with `protected`."""
    return storage.resolve(path, filesystem).path
