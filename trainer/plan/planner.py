"""plan / recommend / check_fits: one worker's memory for a job at a world size, and the choice.

    from trainer.plan import plan, recommend, check_fits
    p = plan(cfg, world_size=64, device_memory_bytes=80 * 2**30)
    print(p.table())
    best = recommend(cfg, 64, 80 * 2**30)[0]     # fits, moves the fewest bytes
    check_fits(cfg, 8, 80 * 2**30)              # ConfigError with the breakdown if it cannot fit
    plan(cfg, 8, 64 * 2**30, headroom=False)    # against the whole memory (CPU workers)

The state terms are the engine's own (layout.py), activations are measured on fake tensors
(activations.py), the step's phases follow the engine's schedule (timeline.py) and the bytes on
the wire replay its accounting (traffic.py). A plan fits when its peak fits in the device's memory
less the headroom a CUDA worker cannot give to tensors (headroom.py: the CUDA context, NCCL's
buffers, the allocator's fragmentation); headroom=False plans against the whole memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from trainer.config import ConfigError, ShardingStrategy, TrainerConfig
from trainer.data import rank_range
from trainer.fsdp.mesh import mesh_shape

from .activations import profile
from .headroom import Headroom, headroom_for
from .layout import layout
from .report import format_plan, format_recommendation, usable_memory
from .timeline import Phase, StepTimeline, step_timeline
from .traffic import bytes_per_step

GiB = 2**30
OFFLOADS = ("none", "optimizer")


@dataclass(frozen=True)
class MemoryPlan:
    """One worker (rank 0: it holds the most rows and the most optimizer state) for one step."""

    model: str
    num_params: int
    num_units: int
    """Units besides the root, in forward order: their kinds (embedding, block, head)."""
    unit_kinds: tuple
    strategy: str
    world_size: int
    shard_size: int
    replicate_size: int
    param_dtype: str
    reduce_dtype: str
    activation_checkpointing: bool
    sharded_grad_accumulation: bool
    offload: bool
    """sharding.offload=optimizer: master weights, gradient shards and AdamW state on the host."""
    rows: int
    """Sequences in this worker's largest micro-batch."""
    seq_len: int
    micro_batches: int
    sharded_params: int
    sharded_grads: int
    optim_state: int
    host_state: int
    """Host bytes of the offloaded optimizer (0 without offload)."""
    snapshot_host: int
    """Host bytes per worker for in-memory snapshots (when TrainConfig.snapshots_on; 0 without):
    the worker's staging copy of its shard state plus its share of what the keepers hold, 2
    copies x 2 generations (trainer/checkpoint/snapshots.py)."""
    timeline: StepTimeline
    activations_without_checkpointing: int
    """Peak of activation memory alone (blocks + root) over the step, without checkpointing."""
    activations_with_checkpointing: int
    bytes_moved: dict
    """Bytes this worker sends per step, by collective (all_gather, reduce_scatter, all_reduce)."""
    device_memory_bytes: int
    headroom: Headroom
    """What of device_memory_bytes is not for tensors (Headroom.none() with headroom=False)."""

    @property
    def model_state(self) -> int:
        """Parameter, gradient and optimizer shards: the ZeRO papers' model state."""
        return self.sharded_params + self.sharded_grads + self.optim_state

    @property
    def persistent(self) -> int:
        """What stays between steps: the gradient shards are freed by zero_grad (set_to_none)."""
        return self.sharded_params + self.optim_state

    @property
    def peak_phase(self) -> Phase:
        return self.timeline.peak_phase

    @property
    def total(self) -> int:
        """Peak bytes of the step: persistent state + everything alive in the largest phase."""
        return self.timeline.peak

    @property
    def usable(self) -> int:
        """Device memory for tensors: the device's less the headroom (negative if it is less)."""
        return self.device_memory_bytes - self.headroom.total

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def total_bytes_moved(self) -> int:
        return sum(self.bytes_moved.values())

    def label(self) -> str:
        ckpt = "with" if self.activation_checkpointing else "without"
        accumulation = ", sharded gradient accumulation" if self.sharded_grad_accumulation else ""
        offload = ", optimizer offloaded to the host" if self.offload else ""
        return f"{self.strategy} {ckpt} activation checkpointing{accumulation}{offload}"

    def table(self) -> str:
        return format_plan(self)


SNAPSHOT_COPIES = 1 + 2 * 2
"""Shard-state copies per worker that snapshots keep in host memory: one staging copy in the
worker, and 2 copies x 2 generations in the keepers (spread over the nodes, one share each)."""


def rows_per_micro_batch(
    global_batch: int, world_size: int, micro_batches: int, rank: int = 0
) -> int:
    """Sequences in `rank`'s largest micro-batch, as trainer.data.Batcher splits a step: the rank's
    share (rank 0 takes one more when uneven) by np.array_split; an empty split runs one
    sequence."""
    lo, hi = rank_range(global_batch, world_size, rank)
    return max(1, math.ceil((hi - lo) / micro_batches))


def plan(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    rank: int = 0,
    *,
    headroom: bool = True,
) -> MemoryPlan:
    """Per-worker memory of `cfg` on `world_size` workers of `device_memory_bytes` each.

    local_world_size is the number of workers per node (HYBRID_SHARD's default shard group).
    headroom: reserve a CUDA worker's context, NCCL buffers and fragmentation margin (headroom.py)
    out of the device's memory; False for CPU workers, or to compare with the whole memory."""
    if world_size < 1:
        raise ConfigError(f"invalid config: world size {world_size}; valid: a positive integer")
    sh, model = cfg.sharding, cfg.model
    micro = cfg.train.micro_batches
    rows = rows_per_micro_batch(cfg.train.global_batch_size, world_size, micro, rank)
    lay = layout(model, sh, world_size, local_world_size, rank)
    acts = {ac: profile(model, rows, cfg.data.seq_len, sh.param_dtype, ac) for ac in (False, True)}
    timelines = {ac: step_timeline(lay, sh, a, micro) for ac, a in acts.items()}
    timeline = timelines[bool(sh.activation_checkpointing)]
    reserved = (
        headroom_for(world_size, lay.shard_size, lay.replicate_size, timeline.peak)
        if headroom
        else Headroom.none()
    )
    return MemoryPlan(
        model=model.name,
        num_params=lay.num_params,
        num_units=len(lay.units),
        unit_kinds=tuple(u.kind for u in lay.units) + (("root",) if lay.root.padded else ()),
        strategy=lay.strategy.value,
        world_size=world_size,
        shard_size=lay.shard_size,
        replicate_size=lay.replicate_size,
        param_dtype=sh.param_dtype,
        reduce_dtype=sh.reduce_dtype,
        activation_checkpointing=bool(sh.activation_checkpointing),
        sharded_grad_accumulation=bool(sh.sharded_grad_accumulation and micro > 1),
        offload=lay.host_state > 0,
        rows=rows,
        seq_len=cfg.data.seq_len,
        micro_batches=micro,
        sharded_params=lay.sharded_params,
        sharded_grads=lay.sharded_grads,
        optim_state=lay.optim_state,
        host_state=lay.host_state,
        snapshot_host=(
            SNAPSHOT_COPIES * (lay.sharded_params + lay.optim_state)
            if cfg.train.snapshots_on(gpu_workers=headroom)
            else 0
        ),
        timeline=timeline,
        activations_without_checkpointing=_activation_peak(timelines[False]),
        activations_with_checkpointing=_activation_peak(timelines[True]),
        bytes_moved=bytes_per_step(lay, sh, micro),
        device_memory_bytes=int(device_memory_bytes),
        headroom=reserved,
    )


def _activation_peak(t: StepTimeline) -> int:
    return max(p.block_activations + p.root_activations for p in t.phases)


def candidates(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
) -> list[MemoryPlan]:
    """Every strategy x activation checkpointing (x, with micro-batches, sharded gradient
    accumulation) x optimizer offload at this world size, dtypes as configured."""
    out = []
    accumulations = (False, True) if cfg.train.micro_batches > 1 else (False,)
    for strategy, ac, sharded, offload in itertools.product(
        _strategies(cfg, world_size, local_world_size), (False, True), accumulations, OFFLOADS
    ):
        sharding = dataclasses.replace(
            cfg.sharding,
            strategy=strategy.value,
            activation_checkpointing=ac,
            sharded_grad_accumulation=sharded,
            offload=offload,
        )
        cand = dataclasses.replace(cfg, sharding=sharding)
        out.append(plan(cand, world_size, device_memory_bytes, local_world_size, headroom=headroom))
    return out


def _strategies(
    cfg: TrainerConfig, world_size: int, local_world_size: int
) -> list[ShardingStrategy]:
    """HYBRID_SHARD only where it differs from the others: 1 < shard group < world size."""
    out = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
    try:
        shard, _ = mesh_shape(
            ShardingStrategy.HYBRID_SHARD,
            world_size,
            cfg.sharding.hybrid_shard_group_size,
            local_world_size,
        )
    except ConfigError:
        return out
    return out + [ShardingStrategy.HYBRID_SHARD] if 1 < shard < world_size else out


def recommend(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
) -> list[MemoryPlan]:
    """The options that fit, fewest bytes moved per step first; among equals, no recomputation
    (checkpointing off) first, then the least memory. Empty when nothing fits. Sharded gradient
    accumulation moves micro_batches x the reduce-scatter bytes, so it comes first only where
    keeping the unsharded gradients does not fit; offloading the optimizer (host memory, PCIe
    copies and a host optimizer step) comes after everything that fits on the device."""
    options = candidates(cfg, world_size, device_memory_bytes, local_world_size, headroom=headroom)
    fitting = [p for p in options if p.fits]
    return sorted(
        fitting,
        key=lambda p: (p.offload, p.total_bytes_moved, p.activation_checkpointing, p.total),
    )


def check_fits(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
) -> MemoryPlan:
    """The plan, or ConfigError with the breakdown and what would fit: call before workers start.

    With micro-batches whose unsharded gradients do not fit, the plan with sharded gradient
    accumulation is returned when that one fits (same gradients, more reduce-scatter traffic):
    the caller turns it on (trainer/loop.py does, and says so)."""
    p = plan(cfg, world_size, device_memory_bytes, local_world_size, headroom=headroom)
    if p.fits:
        return p
    if cfg.train.micro_batches > 1 and not cfg.sharding.sharded_grad_accumulation:
        sharding = dataclasses.replace(cfg.sharding, sharded_grad_accumulation=True)
        alt = plan(
            dataclasses.replace(cfg, sharding=sharding),
            world_size,
            device_memory_bytes,
            local_world_size,
            headroom=headroom,
        )
        if alt.fits:
            return alt

    options = recommend(cfg, world_size, device_memory_bytes, local_world_size, headroom=headroom)
    raise ConfigError(
        f"invalid config: sharding.strategy={p.strategy} with sharding.activation_checkpointing="
        f"{p.activation_checkpointing} on {world_size} workers needs {p.total / GiB:.2f} GiB "
        f"per worker, more than {usable_memory(p)}; valid: a configuration that fits.\n\n"
        f"{p.table()}\n\n{format_recommendation(options, p)}"
    )
