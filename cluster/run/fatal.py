"""The error that ends a launch's training for good, handed from the workers to the driver.

    except fatal_errors() as e:                       # in each worker, around the loop
        end_fatally(folder, rank, launch_id, e)       # rank 0 writes elastic/fatal.json
    error = fatal_error(cfg.cluster, launch_id)       # the driver, after fit: exit 1 with it

Ray Train 2.60 retries every worker failure (its failure policy has no per-error rule), so an
error that every rank raises alike, and a restart would only repeat, ends the workers cleanly
instead, and the driver reads why from the run folder.
"""

from __future__ import annotations

from typing import Optional

from cluster.config import ClusterConfig
from cluster.run.folder import RunFolder
from trainer.config import ConfigError
from trainer.guard import DivergenceError
from trainer.metrics import print0

FATAL = "fatal.json"
"""In the run's elastic/ folder: the error that ended a launch's training for good."""


def fatal_errors() -> tuple[type, ...]:
    """Errors that every rank raises alike and a restart would only repeat: the run diverged, or
    the configuration does not fit the run (a checkpoint of another model, a vocabulary too
    small), or another launch took the run over."""
    # the checkpointer (and the checkpoint format behind it): for the workers, not the driver
    from trainer.checkpoint.checkpointer import RunTakenOver  # noqa: PLC0415 -- see above

    return (DivergenceError, ConfigError, RunTakenOver)


def end_fatally(folder: RunFolder, rank: int, launch_id: str, error: Exception) -> None:
    """Rank 0 records the error for the driver (durable: the driver reads it after fit)."""
    if rank == 0:
        doc = {"launch_id": launch_id, "type": type(error).__name__, "error": str(error)}
        folder.write(FATAL, doc, durable=True)
    print0(f"error: {type(error).__name__}: {error} (not retried: a restart would repeat it)")


def fatal_error(cluster: ClusterConfig, launch_id: str) -> Optional[str]:
    """The driver's side: the error this launch's workers ended with, if they recorded one."""
    record = RunFolder.of_run(cluster).read(FATAL)
    if record and record.get("launch_id") == launch_id:
        return f"{record['type']}: {record['error']}"
    return None
