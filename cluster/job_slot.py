"""Where a job sits in a sweep: its number, its swept values, its repeat, the parent run. The
sweep's callback (cluster/sweep.py) tells its jobs through the environment, which any Hydra
launcher passes on; each job reads its slot back here (cluster/train.py, tracking/job.py).

    slot = current_slot()             # None in a plain run
    name = sweep_run_name(cfg.cluster.run_name, slot)    # the job's own Ray run name
    print(slot.prefix + "...")        # '[job 3/4 sharding=no_shard] ...'
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

PARENT_RUN_ENV = "ELASTIC_FSDP_SWEEP_PARENT_RUN_ID"
"""The sweep's parent MLflow run id, set by SweepCallback for the jobs (env: any launcher sees
it)."""
SWEPT_KEYS_ENV = "ELASTIC_FSDP_SWEEP_KEYS"
"""Comma-separated keys the sweep varies; a job's run is named after its values of these."""
SWEEP_JOBS_ENV = "ELASTIC_FSDP_SWEEP_JOBS"
SWEEP_REPEAT_ENV = "ELASTIC_FSDP_SWEEP_REPEAT"
"""Comma-separated, per job: which repeat of its configuration it is (from 0)."""
SWEEP_VARIED_ENV = "ELASTIC_FSDP_SWEEP_VARIED"
"""Comma-separated config keys (flattened) whose values differ between the jobs: MLflow params
of every child, beside cluster/tracking/runs.py COMPARED_PARAMS."""


@dataclass(frozen=True)
class JobSlot:
    """Where a job sits in a sweep; None stands for a plain run."""

    num: int
    """hydra.job.num: the job's index in the sweep."""
    sweep_dir: str
    """Absolute hydra.sweep.dir."""
    label: str
    """The job's values of the swept keys, e.g. 'sharding=no_shard'."""
    parent_run_id: Optional[str] = None
    """The sweep's MLflow parent run; None when tracking is off."""
    total: Optional[int] = None
    """How many jobs the sweep has (None when its sweeper decides as it goes)."""
    repeat: int = 0
    """Which repeat of its configuration this job is, from 0 (+sweep.repeats)."""
    repeated: bool = False
    """Whether the sweep repeats its jobs: the run names then count the repeats."""
    varied: tuple = ()
    """The config keys whose values differ between the sweep's jobs (MLflow params)."""

    @property
    def name(self) -> str:
        """'job 3/4': counted from 1, of the sweep's jobs (Hydra's folder is num, from 0)."""
        return f"job {self.num + 1}/{self.total}" if self.total else f"job {self.num + 1}"

    @property
    def run_name(self) -> str:
        """The job's MLflow run name: its swept values, and '#2' for its second repeat."""
        label = self.label or f"job {self.num}"
        return f"{label} #{self.repeat + 1}" if self.repeated else label

    @property
    def prefix(self) -> str:
        """What every console line of the job starts with: '[job 3/4 sharding=no_shard] '."""
        label = self.run_name if self.label else ""
        return f"[{' '.join(p for p in (self.name, label) if p)}] "


def current_slot() -> Optional[JobSlot]:
    """The running job's slot from HydraConfig, or None outside a multirun."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    keys = [k for k in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if k]
    overrides = list(hydra_cfg.overrides.task)
    num = int(hydra_cfg.job.num)
    repeats = [int(r) for r in os.environ.get(SWEEP_REPEAT_ENV, "").split(",") if r]
    return JobSlot(
        num=num,
        sweep_dir=os.path.abspath(hydra_cfg.sweep.dir),
        label=job_label(overrides, keys),
        parent_run_id=os.environ.get(PARENT_RUN_ENV) or None,
        total=int(os.environ.get(SWEEP_JOBS_ENV) or 0) or None,
        repeat=repeats[num] if num < len(repeats) else 0,
        repeated=any(repeats),
        varied=tuple(k for k in os.environ.get(SWEEP_VARIED_ENV, "").split(",") if k),
    )


def job_label(overrides: list[str], swept: list[str]) -> str:
    """The overrides of the swept keys, in the order given: 'sharding=no_shard train.steps=5'."""
    return " ".join(o for o in overrides if o.split("=", 1)[0] in swept)


def sweep_run_name(run_name: str, slot: JobSlot) -> str:
    """cluster.run_name of a sweep's job: one per job and per sweep directory.

    The digest of the sweep directory keeps two sweeps apart; the job number keeps the jobs of
    one sweep apart (each trains from step 0, never from its neighbour's checkpoint)."""
    digest = hashlib.sha1(slot.sweep_dir.encode()).hexdigest()[:8]
    return f"{run_name}-sweep{digest}-{slot.num}"
