"""The driver's last checks before Ray: what the workers would otherwise find, minutes later.

    cfg = checked_config(dictcfg, launch_dir)    # values, paths, sources, the checkpoint to resume
    plan = preflight(cfg)                        # the prepared data intact, the storage writable
    connect_largest([cfg]); prepare_data(cfg, plan); ...

A problem found in a worker costs a Ray start and cluster.max_failures + 1 tries of the worker
group, each with its tracebacks; found here it is one `error:` line (a ConfigError) in seconds,
before Ray starts and before the MLflow run exists. checked_config already refuses a resumable
checkpoint of another model, global batch or data (trainer.checkpointing.preflight_resume); this
adds what needs the storage itself:

- the prepared data, when a preparation of this job exists: its manifest reads, every shard is
  there with the size it records (one LIST), and, up to CHECKSUM_MAX_BYTES in all, every shard's
  crc32 is as recorded (a flipped byte would otherwise surface as a bad token id in a worker);
- the run's checkpoint folder takes a write: a small uniquely named probe file, removed again.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from cluster.config import ConfigError, JobConfig
from trainer import storage
from trainer.data import MANIFEST, DataError, PreparedData
from trainer.data.preparation import Plan, plan_preparation
from trainer.storage import Location

CHECKSUM_MAX_BYTES = 2 * 2**30
"""A preparation up to this size has every shard's crc32 checked (zlib reads a few GB/s locally);
a larger one only its shard sizes, and a line says how to verify it in full."""


def preflight(cfg: JobConfig, log=print) -> Plan:
    """ConfigError when the prepared data is damaged or the storage cannot be written; the
    data's preparation plan otherwise (prepare_data takes it: the sources are listed once)."""
    plan = plan_preparation(cfg.data)
    check_prepared_data(plan.root, log)
    check_storage_writable(cfg.checkpoint_root, cfg.cluster.storage_path)
    return plan


def check_prepared_data(root: Location, log=print) -> None:
    """A preparation at `root` (if any) is whole: the manifest, each shard's size, and its crc32
    when the whole preparation is at most CHECKSUM_MAX_BYTES."""
    try:
        data = PreparedData.open(str(root))
    except (DataError, OSError) as e:
        if not storage.exists(root.child(MANIFEST)):
            return None  # not prepared yet (or not finished): prepare_data will do it
        raise ConfigError(_damaged(root, str(e))) from None
    listing = storage.list_dir(root)  # one LIST: every shard's size
    shards = [sh for s in data.manifest.sources for sp in s.splits.values() for sh in sp.shards]
    for shard in shards:
        info = listing.get(shard.name)
        if info is None or info.size != shard.nbytes:
            found = "missing" if info is None else f"{info.size} bytes"
            raise ConfigError(
                _damaged(root, f"{root}/{shard.name}: {found}, the manifest records {shard.nbytes}")
            )
    total = sum(sh.nbytes for sh in shards)
    if total > CHECKSUM_MAX_BYTES:
        log(
            f"data: {total / 2**30:.1f} GiB prepared in {root}: shard sizes checked, checksums "
            f"not read (python -m trainer.data inspect {root} --verify reads them all)"
        )
        return None
    start = time.monotonic()
    problems = data.verify()
    if problems:
        raise ConfigError(_damaged(root, "; ".join(problems)))
    log(
        f"data: {len(shards)} shards ({total / 2**20:.1f} MiB) verified in "
        f"{time.monotonic() - start:.2f} s"
    )
    return None


def _damaged(root: Location, problem: str) -> str:
    return (
        f"invalid prepared data: {problem}; valid: an intact preparation: delete {root} and run "
        "again to prepare it anew (python -m cluster.prepare, or any training run)"
    )


def check_storage_writable(root: str, storage_path: Optional[str] = None) -> None:
    """Create `root` (the run's checkpoint folder) and write, then delete, a small uniquely named
    probe file in it; ConfigError naming the folder and the OS error when that fails."""
    probe_name = f".preflight-{uuid.uuid4().hex}"
    try:
        loc = storage.resolve(root)
        loc.fs.create_dir(loc.path, recursive=True)
        probe = loc.child(probe_name)
        storage.write_bytes(probe, b"elastic-fsdp preflight: this folder takes writes\n")
        storage.delete_file(probe)
    except OSError as e:
        key = f"cluster.storage_path={storage_path!r}: " if storage_path is not None else ""
        raise ConfigError(
            f"invalid config: {key}the run's checkpoint folder {root} is not writable "
            f"({type(e).__name__}: {e}); valid: a writable local path or pyarrow.fs URI "
            "(s3://, gs://) with write access"
        ) from None
