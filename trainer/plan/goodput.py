"""Goodput: the share of a run's wall time that trains, given how often something fails and what
each failure costs, and the in-memory snapshot and durable checkpoint intervals that maximise it.

    from trainer.plan.goodput import Recovery, plan_goodput
    g = plan_goodput(step_s=6.2, world=4096, state_bytes=207e6, hw=hardware("h100"), replicas=1)
    g.goodput, g.snapshot_every, g.checkpoint_every     # the fraction, the intervals in steps
    g.tokens_per_day(tokens_per_step=4096 * 4096)

    python -m cluster.plan model=70b --gpus 4096 ...    # prints it for the recommendation

A failure (FAILURES_PER_GPU_HOUR x GPUs an hour) costs: noticing it (Ray's health check), the
restart of the group (benchmarks.recovery: into spare processes, or new ones), loading the state
(from a peer node's in-memory snapshot over the network, or from the durable checkpoint at the
storage's rate) and the work since that snapshot or checkpoint (half an interval on average,
and the step in flight). Protection costs the training thread the copy of its shard state to
host memory at each snapshot and each checkpoint (the save is asynchronous: it waits for the
copy only, benchmarks.checkpoint: 0.06-0.09x of a synchronous save); sending a snapshot to the
peer and writing a checkpoint run behind training, so an interval is at least as many steps as
they take. A failure loses the in-memory snapshot only when both copies of a shard are gone
(its node and the next one): taken as the Llama 3 report's network switch and cable share of
failures (a switch takes a rack), the rest recover from the snapshot.

The intervals maximise goodput = step / (step + protection per step) x (1 - failures/s x
seconds lost per failure), each on its own (snapshot and checkpoint terms separate), checked
against the Young/Daly optimum sqrt(2 x copy x MTBF) (Daly's correction included).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .hardware import Hardware

# The Llama 3 report (Dubey et al., "The Llama 3 Herd of Models", arXiv 2407.21783, section
# 3.3.4 and Table 5): in a 54-day snapshot of pre-training on 16,384 H100 GPUs, 466 job
# interruptions, 47 planned and 419 unexpected; of those, 35 network switch / cable.
FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
"""Unexpected interruptions per GPU-hour: 1.97e-5 (one every 3.1 h on 16,384 GPUs)."""
BOTH_COPIES_LOST = 35 / 419
"""The share of failures taken to lose a node and its snapshot peer at once (switch / cable)."""

# benchmarks.recovery (docs/elastic.md, "Measured recovery"): a worker crash, medians of 3, from
# the failure to the first step done after the resume, on a local multi-node Ray.
RESTART_SPARES_S = 2.27
RESTART_NEW_S = 10.09
DETECT_S = 1.0
"""cluster.health_check_interval_s: a dead worker is noticed within it (on top of the above)."""
LOAD_GBS = 1.69
"""Per rank, a checkpoint's load: benchmarks.checkpoint read 1.57 GiB/s (docs/checkpoints.md);
taken for its write too."""
STORAGE_GBS = 2000.0
"""The store's aggregate rate, GB/s: the Llama 3 report's Tectonic sustained 2 TB/s."""
MAX_INTERVAL = 10**6


@dataclass(frozen=True)
class Recovery:
    """What a failure and its protection cost, and how often failures come."""

    failures_per_gpu_hour: float = FAILURES_PER_GPU_HOUR
    both_copies_lost: float = BOTH_COPIES_LOST
    spares: bool = True
    """Restart into spare processes (cluster.spare_workers) or new ones."""
    snapshots: bool = True
    """In-memory snapshots on peer nodes (train.snapshot_every); off: durable checkpoints only."""
    restart_s: float = RESTART_SPARES_S
    restart_new_s: float = RESTART_NEW_S
    extra_restart_s: float = 0.0
    """What a restart costs at this scale beyond what was measured (NCCL communicators over
    thousands of ranks, Ray placing hundreds of nodes): not measured here, 0 by default."""
    detect_s: float = DETECT_S
    load_gbs: float = LOAD_GBS
    storage_gbs: float = STORAGE_GBS


@dataclass(frozen=True)
class Goodput:
    """The intervals chosen and what they give."""

    goodput: float
    step_s: float
    snapshot_every: int
    """Steps between in-memory snapshots (0: off)."""
    checkpoint_every: int
    young_daly_snapshot_s: float
    young_daly_checkpoint_s: float
    mtbf_s: float
    """Mean time between failures of the whole run."""
    lost_per_failure_s: float
    """Seconds a failure costs on average (restart, load, lost work)."""

    def tokens_per_day(self, tokens_per_step: int) -> float:
        return self.goodput * tokens_per_step / self.step_s * 86400


def _young_daly(copy_s: float, mtbf_s: float) -> float:
    """Daly's optimum checkpoint interval (seconds of work) for a checkpoint of `copy_s`."""
    if copy_s <= 0 or math.isinf(mtbf_s):
        return math.inf
    if copy_s >= 2 * mtbf_s:
        return mtbf_s
    young = math.sqrt(2 * copy_s * mtbf_s)
    return young * (1 + math.sqrt(copy_s / (2 * mtbf_s)) / 3 + copy_s / (18 * mtbf_s)) - copy_s


def _best_interval(copy_s: float, rate: float, wall_s: float, floor: int) -> int:
    """Steps k >= floor minimising copy/k per step + rate x (k x wall / 2) per second (the
    protection's cost against the work a failure loses), over integers."""
    if rate <= 0:
        return MAX_INTERVAL
    ideal = math.sqrt(2 * copy_s / rate) / wall_s if copy_s > 0 else 1.0
    candidates = {max(floor, k) for k in (math.floor(ideal), math.ceil(ideal), 1)}
    cost = lambda k: copy_s / (k * wall_s) + rate * k * wall_s / 2
    return min((min(k, MAX_INTERVAL) for k in candidates), key=cost)


def plan_goodput(
    step_s: float,
    world: int,
    state_bytes: float,
    hw: Hardware,
    recovery: Recovery = Recovery(),
    replicas: int = 1,
) -> Goodput:
    """The intervals that maximise goodput for a step of `step_s` on `world` GPUs each holding
    `state_bytes` of shard state (master + moments: what a snapshot and a checkpoint copy), in
    `replicas` identical copies (HYBRID_SHARD's replicas: only the first writes a checkpoint,
    every rank reads one back)."""
    r = recovery
    rate = r.failures_per_gpu_hour * world / 3600  # failures a second
    copy = state_bytes / (hw.pcie_gbs * 1e9)  # the training thread waits for this copy
    write = min(r.load_gbs, r.storage_gbs / max(1, world // replicas)) * 1e9
    store = min(r.load_gbs, r.storage_gbs / world) * 1e9  # every rank reads at a resume
    restart = r.detect_s + (r.restart_s if r.spares else r.restart_new_s) + r.extra_restart_s
    durable_rate = rate * (r.both_copies_lost if r.snapshots else 1.0)
    snap_rate = rate - durable_rate
    snap_floor = max(1, math.ceil(state_bytes / (hw.inter.gbs * 1e9) / step_s))
    ckpt_floor = max(1, math.ceil(state_bytes / write / step_s))
    ks = _best_interval(copy, snap_rate, step_s, snap_floor) if r.snapshots else 0
    kd = _best_interval(copy, durable_rate, step_s, ckpt_floor)
    wall = step_s + (copy / ks if ks else 0.0) + copy / kd
    lost_snap = restart + state_bytes / (hw.inter.gbs * 1e9) + (ks + 1) * wall / 2
    lost_durable = restart + state_bytes / store + (kd + 1) * wall / 2
    waste = snap_rate * lost_snap + durable_rate * lost_durable
    mtbf = lambda r: 1 / r if r > 0 else math.inf
    return Goodput(
        goodput=max(0.0, step_s / wall * (1 - waste)),
        step_s=step_s,
        snapshot_every=ks,
        checkpoint_every=kd,
        young_daly_snapshot_s=_young_daly(copy, mtbf(snap_rate)) if ks else math.inf,
        young_daly_checkpoint_s=_young_daly(copy, mtbf(durable_rate)),
        mtbf_s=mtbf(rate),
        lost_per_failure_s=waste * mtbf(rate) if rate > 0 else 0.0,
    )


VARIANTS = (
    ("spares and in-memory snapshots (the default)", {}),
    ("no spares (new processes)", {"spares": False}),
    ("no in-memory snapshots (durable only)", {"snapshots": False}),
    ("neither", {"spares": False, "snapshots": False}),
)
"""The rows of `goodput_table`: what each of the two costs a run when it is missing."""

SENSITIVITY = (
    ("store 10 GB/s", {"storage_gbs": 10.0}),
    ("restart +10 min", {"extra_restart_s": 600.0}),
)
"""The table's other columns: the same rows where the store writes 10 GB/s in all (a single
file server, not a parallel store), and where a restart takes 10 more minutes than measured here
(what NCCL and Ray may take at thousands of ranks: not measured)."""


@dataclass(frozen=True)
class Row:
    """One protection: its Goodput as given, and under each SENSITIVITY column."""

    label: str
    goodput: Goodput
    columns: tuple[Goodput, ...]


def goodput_table(
    step_s: float,
    world: int,
    state_bytes: float,
    hw: Hardware,
    recovery: Recovery = Recovery(),
    replicas: int = 1,
) -> list[Row]:
    """Every VARIANTS row, intervals chosen for each, under the inputs and each SENSITIVITY."""

    def at(**kw) -> Goodput:
        again = dataclasses.replace(recovery, **kw)
        return plan_goodput(step_s, world, state_bytes, hw, again, replicas)

    return [
        Row(label, at(**kw), tuple(at(**kw, **other) for _, other in SENSITIVITY))
        for label, kw in VARIANTS
    ]
