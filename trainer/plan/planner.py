"""plan / recommend: one worker's memory for a job at a world size, and the strategies that fit.

    from trainer.plan import plan, recommend
    p = plan(cfg, world_size=64, device_memory_bytes=80 * 2**30)
    print(p.table())
    best = recommend(cfg, 64, 80 * 2**30)[0]     # fits, moves the fewest bytes
    plan(cfg, 8, 64 * 2**30, headroom=False)    # against the whole memory (CPU workers)

The memory levers, the one answer and the check before workers start (check_fits) are
choose.py's.

The state terms are the engine's own (layout.py), activations are measured on fake tensors
(activations.py), the step's phases follow the engine's schedule (timeline.py) and the bytes on
the wire replay its accounting (traffic.py). A plan fits when its peak fits in the device's memory
less the headroom a CUDA worker cannot give to tensors (headroom.py: the CUDA context, NCCL's
buffers, the allocator's fragmentation); headroom=False plans against the whole memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from trainer.config import ConfigError, ShardingStrategy, TrainerConfig
from trainer.fsdp.mesh import mesh_shape
from trainer.model import count_params

from .activations import profile
from .headroom import Headroom, headroom_for
from .layout import layout
from .levers import HOST_BASELINE_BYTES, host_step_bytes
from .report import format_plan
from .timeline import Phase, StepTimeline, step_timeline
from .tokens import context_tokens, image_patches, router_bytes, rows_per_micro_batch
from .tower import tower_profile, with_tower
from .traffic import all_to_all_bytes, bytes_per_step, context_bytes, pcie_per_step

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
    """sharding.offload=optimizer or params: master weights, gradient shards and AdamW state on
    the host (offload_level says which)."""
    offload_level: str
    """sharding.offload: none, optimizer or params (no shard on the device either)."""
    master_dtype: str
    """sharding.master_dtype of the sharded master parameters."""
    state_dtype: str
    """optim.state_dtype of AdamW's moments."""
    master_rounding: str
    """sharding.master_rounding (what a bf16 master keeps besides itself: levers.BYTES)."""
    rows: int
    """Sequences in this worker's largest micro-batch."""
    seq_len: int
    micro_batches: int
    sharded_params: int
    sharded_grads: int
    optim_state: int
    host_state: int
    """Host bytes of the offloaded state (0 without offload)."""
    host_staging: int
    """Pinned host buffers the reduced gradient shards are copied into (0 without offload)."""
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
    pcie: dict
    """Bytes over this worker's PCIe link per step: host_to_device, device_to_host (levers.py)."""
    host_step_bytes: int
    """Host memory traffic of the offloaded optimizer step (0 without offload, levers.py)."""
    workers_per_node: int
    """min(local_world_size, world_size): the workers sharing one node's host memory."""
    host_memory_bytes: Optional[int]
    """Host memory per node to check against (None: not checked)."""
    device_memory_bytes: int
    headroom: Headroom
    """What of device_memory_bytes is not for tensors (Headroom.none() with headroom=False)."""
    active_params: int = 0
    """Parameters one token computes with (a mixture's top-k experts; all for a dense model)."""
    experts_per_rank: int = 0
    """A mixture's experts each worker holds of every sparse layer (0: a dense model)."""
    router_activations: int = 0
    """A mixture's routers' saved activations over a micro-batch, every sparse layer (part of the
    blocks' activations, shown apart): router_bytes."""
    context_parallel: int = 1
    """train.context_parallel: each sequence split over this many workers, which read the same
    samples (`rows` is per data rank: the world over this degree) and compute 2c of each
    sequence's tokens, c = ceil(seq_len / 2N)."""
    frozen_params: int = 0
    """Parameters train.freeze froze: in the shards, but with no gradient, no reduce-scatter and
    no optimizer state (the layout and the traffic read it off the engine's frozen flats)."""
    image_patches: int = 0
    """A vision-language model: the patches of this worker's micro-batch its tower was priced
    at (every token an image token unless plan() was told image_tokens); 0 without a tower."""
    tower_activations: int = 0
    """What the tower keeps for its backward over those patches, the pixels included (alive
    through the decoder's forward and backward; part of the activations above): tower.py."""

    @property
    def tokens_per_row(self) -> int:
        """Tokens of each sequence this worker computes: 2c (all of seq_len without a split)."""
        n = self.context_parallel
        return self.seq_len if n == 1 else 2 * -(-self.seq_len // (2 * n))

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

    @property
    def pcie_bytes(self) -> int:
        return sum(self.pcie.values())

    @property
    def host_per_worker(self) -> int:
        """Host bytes one worker needs: its process, offloaded state and staging, snapshots."""
        return HOST_BASELINE_BYTES + self.host_state + self.host_staging + self.snapshot_host

    @property
    def host_per_node(self) -> int:
        return self.workers_per_node * self.host_per_worker

    @property
    def fits_host(self) -> bool:
        """The node's workers fit in its host memory (True when no host memory was given)."""
        return self.host_memory_bytes is None or self.host_per_node <= self.host_memory_bytes

    @property
    def fits_all(self) -> bool:
        """Fits the device and the host."""
        return self.fits and self.fits_host

    @property
    def levers(self) -> tuple[str, ...]:
        """The memory levers this plan uses, as overrides (levers.py prices them)."""
        out = []
        if self.state_dtype != "float32":
            out.append(f"optim.state_dtype={self.state_dtype}")
        if self.master_dtype != "float32":
            out.append(f"sharding.master_dtype={self.master_dtype}")
        if self.offload_level != "none":
            out.append(f"sharding.offload={self.offload_level}")
        return tuple(out)

    def label(self) -> str:
        ckpt = "with" if self.activation_checkpointing else "without"
        accumulation = ", sharded gradient accumulation" if self.sharded_grad_accumulation else ""
        offload = {
            "none": "",
            "optimizer": ", optimizer offloaded to the host",
            "params": ", parameters and optimizer offloaded to the host",
        }[self.offload_level]
        dtypes = "".join(
            f", {what} {dtype}"
            for what, dtype in (("moments", self.state_dtype), ("master", self.master_dtype))
            if dtype != "float32"
        )
        offload = dtypes + offload
        return f"{self.strategy} {ckpt} activation checkpointing{accumulation}{offload}"

    def table(self) -> str:
        return format_plan(self)


SNAPSHOT_COPIES = 1 + 2 * 2
"""Shard-state copies per worker that snapshots keep in host memory: one staging copy in the
worker, and 2 copies x 2 generations in the keepers (spread over the nodes, one share each)."""


def plan(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    rank: int = 0,
    *,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = None,
    image_tokens: Optional[int] = None,
) -> MemoryPlan:
    """Per-worker memory of `cfg` on `world_size` workers of `device_memory_bytes` each.

    local_world_size is the number of workers per node (HYBRID_SHARD's default shard group, and
    the workers that share a node's host memory). headroom: reserve a CUDA worker's context, NCCL
    buffers and fragmentation margin (headroom.py) out of the device's memory; False for CPU
    workers, or to compare with the whole memory. host_memory_bytes: per node, to check the
    host side against (None: fits_host is True). image_tokens: a vision-language model's image
    tokens per sequence (None: data.seq_len, every token, the most a window holds), each
    merge**2 patches through its tower."""
    if world_size < 1:
        raise ConfigError(f"invalid config: world size {world_size}; valid: a positive integer")
    sh, model = cfg.sharding, cfg.model
    micro, cp = cfg.train.micro_batches, cfg.train.context_parallel
    # the mesh at this world size (a resize may re-plan the expert axis: trainer/fsdp/mesh.py;
    # a context degree that does not divide it is a ConfigError naming the valid ones)
    shape = mesh_shape(sh, world_size, local_world_size, model.moe_experts, cp)
    ep = shape["expert"]
    # the ranks of a context group read the same samples: the batch is split over the rest
    rows = rows_per_micro_batch(cfg.train.global_batch_size, world_size // cp, micro, rank // cp)
    lay = layout(
        model, sh, world_size, local_world_size, rank, cfg.optim.state_dtype, cp, cfg.train.freeze
    )
    chunk = cfg.train.loss_chunk_tokens
    patches = image_patches(model, rows, cfg.data.seq_len, image_tokens)
    freeze = tuple(cfg.train.freeze)
    acts = {
        ac: with_tower(
            profile(model, rows, cfg.data.seq_len, sh.param_dtype, ac, chunk, cp),
            tower_profile(model, patches, sh.param_dtype, ac, freeze),
        )
        for ac in (False, True)
    }
    tokens = rows * context_tokens(cfg.data.seq_len, cp)  # this worker's, per micro-batch
    timelines = {ac: step_timeline(lay, sh, a, micro) for ac, a in acts.items()}
    timeline = timelines[bool(sh.activation_checkpointing)]
    reserved = (
        headroom_for(world_size, lay.shard_size, lay.replicate_size, timeline.peak)
        if headroom
        else Headroom.none()
    )
    return MemoryPlan(
        model=model.name,
        num_params=count_params(model),  # the whole model (a worker holds only its experts)
        num_units=len(lay.units),
        active_params=count_params(model, active=True),
        experts_per_rank=model.moe_experts // ep,
        router_activations=router_bytes(model, tokens, sh.param_dtype.itemsize),
        unit_kinds=tuple(u.kind for u in lay.units) + (("root",) if lay.root.padded else ()),
        strategy=lay.strategy.value,
        world_size=world_size,
        shard_size=lay.shard_size,
        replicate_size=lay.replicate_size,
        param_dtype=sh.param_dtype,
        reduce_dtype=sh.reduce_dtype,
        activation_checkpointing=bool(sh.activation_checkpointing),
        sharded_grad_accumulation=bool(sh.sharded_grad_accumulation and micro > 1),
        offload=lay.offload != "none",
        offload_level=lay.offload,
        master_dtype=str(sh.master_dtype),
        state_dtype=str(cfg.optim.state_dtype),
        master_rounding=str(sh.master_rounding),
        rows=rows,
        seq_len=cfg.data.seq_len,
        micro_batches=micro,
        sharded_params=lay.sharded_params,
        sharded_grads=lay.sharded_grads,
        optim_state=lay.optim_state,
        host_state=lay.host_state,
        host_staging=lay.host_staging,
        snapshot_host=(
            SNAPSHOT_COPIES * lay.shard_state if cfg.train.snapshots_on(gpu_workers=headroom) else 0
        ),
        timeline=timeline,
        activations_without_checkpointing=_activation_peak(timelines[False]),
        activations_with_checkpointing=_activation_peak(timelines[True]),
        bytes_moved=bytes_per_step(
            lay,
            sh,
            micro,
            all_to_all_bytes(
                model,
                tokens * micro,
                ep,
                sh.param_dtype.itemsize,
                bool(sh.activation_checkpointing),
            ),
            context_bytes(
                model,
                tokens * micro,
                cp,
                sh.param_dtype.itemsize,
                bool(sh.activation_checkpointing),
            ),
        ),
        context_parallel=cp,
        frozen_params=lay.frozen_elements,
        image_patches=patches,
        tower_activations=_tower_retained(acts[bool(sh.activation_checkpointing)]),
        pcie=pcie_per_step(lay, sh, micro),
        host_step_bytes=(
            host_step_bytes(
                lay.shard_elements,
                lay.grad_elements,
                lay.optim_elements,
                str(sh.master_dtype),
                str(cfg.optim.state_dtype),
            )
            if lay.offload != "none"
            else 0
        ),
        workers_per_node=min(local_world_size, world_size),
        host_memory_bytes=None if host_memory_bytes is None else int(host_memory_bytes),
        device_memory_bytes=int(device_memory_bytes),
        headroom=reserved,
    )


def _tower_retained(acts) -> int:
    return acts.tower.retained if acts.tower is not None else 0


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
        strategies(cfg, world_size, local_world_size), (False, True), accumulations, OFFLOADS
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


def strategies(
    cfg: TrainerConfig, world_size: int, local_world_size: int
) -> list[ShardingStrategy]:
    """The strategies that differ at this world size: on one worker only the configured one (with
    a shard group of one they are the same job: nothing sharded, nothing sent); HYBRID_SHARD only
    where 1 < shard group < world size (otherwise it is FULL_SHARD or NO_SHARD) and its shard
    group holds train.context_parallel."""
    if world_size == 1:
        return [cfg.sharding.strategy]
    out = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
    try:
        hybrid = dataclasses.replace(cfg.sharding, strategy=ShardingStrategy.HYBRID_SHARD)
        shard = mesh_shape(hybrid, world_size, local_world_size)["shard"]
        # the context axis is cut from the shard group: it must divide it
        mesh_shape(hybrid, world_size, local_world_size, context=cfg.train.context_parallel)
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
