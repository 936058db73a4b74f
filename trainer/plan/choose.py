"""The planner chooses: every mesh and combination of the memory levers, what each step takes,
and the one answer: the best predicted tokens/s per GPU (the fastest step) among the
configurations that fit the device and the host.

    from trainer.plan.choose import options, choose
    opts = options(cfg, world_size=1024, device_memory_bytes=80 * 2**30, strategies=...)
    best = choose(opts)  # or choose(opts, step_times) with another model's seconds per step
    best.overrides       # ('sharding.strategy=FULL_SHARD', 'sharding.activation_...', ...)
    best.step_s, best.time.tokens_per_s_per_gpu   # steptime.py's prediction

    python -m cluster.plan model=70b cluster.num_workers=1024 device_memory_gb=80   # the answer
    check_fits(cfg, 8, 80 * 2**30, host_memory_bytes=2**40)  # before workers: or ConfigError

The candidates: the mesh (the sharding strategy as configured, or every one that differs at
this world size: `strategies`; HYBRID_SHARD with every shard group of a node x 2^k that divides
the world, hybrid_groups), activation checkpointing off/on, train.micro_batches (the configured
count and every power of two up to the worker's sequences; with more than one, sharded gradient
accumulation off/on), optim.state_dtype, sharding.master_dtype, sharding.offload none |
optimizer | params, and in-memory snapshots as configured or off (train.snapshot_every=0: a host
memory lever). The dtypes of compute and reduction stay as configured. The memory planner
(planner.py) is the judge of what fits.

What a candidate's step takes is steptime.py's model on a Hardware (hardware.py; default: nodes of
H100s with NVLink and 400 Gb/s InfiniBand a GPU): compute at the device's rate, the recomputation
of activation checkpointing, each collective on its links and what of it compute hides, the
optimizer step, offload traffic over PCIe and the host's optimizer step. The choice is one
function, `choose`, given the candidates and their predicted step times (CHOICE_RULE): the
fastest that fits, with those within TIE_FRACTION of it tied and settled by the mildest levers
(LEVER_WEIGHT), fewer micro-batches, the faster, the least device memory. Another step-time model
hands its own times to `choose`, and the rule stays.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from trainer.config import STATE_DTYPES, ConfigError, ShardingStrategy, TrainerConfig
from trainer.data import rank_range
from trainer.fsdp.config import Offload
from trainer.fsdp.mesh import mesh_shape

from .hardware import Hardware, hardware
from .levers import DEFAULT_HOST_MEMORY_GB, Costs, GiB
from .planner import MemoryPlan, plan, recommend
from .report import format_recommendation, usable_memory
from .steptime import StepTime, step_time

MASTER_DTYPES = ("float32", "bfloat16")  # sharding.master_dtype's valid values
OFFLOAD_LEVELS = tuple(level.value for level in Offload)
MAX_MICRO_BATCHES = 64

LEVER_WEIGHT = {
    "optim.state_dtype=bfloat16": 1,  # bf16 moments: the update is still computed in fp32
    "sharding.master_dtype=bfloat16": 2,  # bf16 master: rounding keeps small updates, mostly
    "train.snapshot_every=0": 4,  # no in-memory snapshots: a lost node costs the last checkpoint
    "sharding.offload=optimizer": 8,  # host memory, PCIe copies and a host optimizer step
    "sharding.offload=params": 16,  # the same, and every gather copies its shard in
}
"""How reluctantly a lever is used where the predicted step times tie: the lower sum wins (each
weight is more than all lighter ones together, so the heaviest lever decides). The offloads are
priced in seconds too (PCIe, host step): with this module's estimate they never tie with the
device's levers; the weights keep the rule's answer sensible under a step-time model that
does not price them."""

TIE_FRACTION = 0.05
"""Predicted steps within this fraction of the fastest count as tied: the model is checked to
within 25% against published runs (benchmarks/plan_vs_published.py), so a few percent is within
its error, and not worth bf16 master weights or a tighter fit."""

CHOICE_RULE = (
    f"the best predicted tokens/s per GPU (the fastest step) that fits; steps within "
    f"{TIE_FRACTION:.0%} of it tie, and ties go to the mildest memory levers, no activation "
    "checkpointing, fewer micro-batches, the faster step, the least device memory"
)
"""The one rule `choose` applies, in the words the planner prints."""


@dataclass(frozen=True)
class Option:
    """One candidate configuration, its plan and its predicted step."""

    plan: MemoryPlan
    snapshots_off: bool
    """The candidate turns off in-memory snapshots that the config has on."""
    time: StepTime
    """steptime.py's prediction of its step."""
    hybrid_group: int = 0
    """HYBRID_SHARD's shard group (sharding.hybrid_shard_group_size); 0 for other strategies."""

    @property
    def compute_s(self) -> float:
        """Forward, backward and the device's optimizer step."""
        return self.time.compute_s + self.time.optimizer_s

    @property
    def recompute_s(self) -> float:
        return self.time.recompute_s

    @property
    def pcie_s(self) -> float:
        return self.time.pcie_s

    @property
    def host_step_s(self) -> float:
        return self.time.host_step_s

    @property
    def network_s(self) -> float:
        """Communication compute did not hide, and the blocking exchanges (all-to-all, K/V)."""
        return self.time.exposed_s + self.time.exchange_s

    @property
    def overhead_s(self) -> float:
        """What the step spends besides its compute: recomputation, PCIe copies, the host's
        optimizer step and the communication that did not hide."""
        return self.recompute_s + self.pcie_s + self.host_step_s + self.network_s

    @property
    def step_s(self) -> float:
        return self.time.step_s

    @property
    def fits(self) -> bool:
        return self.plan.fits_all

    @property
    def levers(self) -> tuple[str, ...]:
        """The memory levers used, as overrides."""
        return self.plan.levers + (("train.snapshot_every=0",) if self.snapshots_off else ())

    @property
    def overrides(self) -> tuple[str, ...]:
        """Everything that makes this candidate, as command-line overrides."""
        p = self.plan
        out = [f"sharding.activation_checkpointing={str(p.activation_checkpointing).lower()}"]
        out.append(f"train.micro_batches={p.micro_batches}")
        if p.sharded_grad_accumulation:
            out.append("sharding.sharded_grad_accumulation=true")
        mesh = (f"sharding.strategy={p.strategy}",)
        if self.hybrid_group:
            mesh += (f"sharding.hybrid_shard_group_size={self.hybrid_group}",)
        return mesh + self.levers + tuple(out)

    @property
    def shortfall(self) -> float:
        """How far from fitting: the larger of the device's excess over its usable memory (as a
        fraction of the device) and the node's excess over its host memory (as a fraction of
        the host); 0 when it fits."""
        return max(self.excess)

    @property
    def excess(self) -> tuple[float, float]:
        """(device, host): each budget's excess as a fraction of it (0 where it fits)."""
        p = self.plan
        device = max(0, p.total - p.usable) / p.device_memory_bytes
        host = 0.0 if p.fits_host else (p.host_per_node - p.host_memory_bytes) / p.host_memory_bytes
        return device, host


def rank_key(o: Option, step_s: float) -> tuple:
    """The order of `options`: the faster predicted step first; equal ones by CHOICE_RULE."""
    return (round(step_s, 6),) + _mildness(o) + (o.plan.total,)


def _mildness(o: Option) -> tuple:
    """The mildest levers, then no recomputation (where compute hides the communication either
    way, checkpointing only spends FLOPs), then fewer micro-batches (fewer, larger micro-batches
    run more efficiently: not priced)."""
    weight = sum(LEVER_WEIGHT.get(lever, 0) for lever in o.levers)
    return (weight, o.plan.activation_checkpointing, o.plan.micro_batches)


def choose(candidates: list[Option], step_times: Optional[list[float]] = None) -> Optional[Option]:
    """The one answer: CHOICE_RULE among the candidates that fit, given each candidate's
    predicted step time (step_times, in the candidates' order; None: their own `step_s`, the
    estimate of `price`). None when nothing fits."""
    times = [o.step_s for o in candidates] if step_times is None else list(step_times)
    if len(times) != len(candidates):
        raise ValueError(f"{len(times)} step times for {len(candidates)} candidates")
    fitting = [(t, o) for o, t in zip(candidates, times) if o.fits]
    if not fitting:
        return None
    fastest = min(t for t, _ in fitting)
    tied = [(t, o) for t, o in fitting if t <= fastest + abs(fastest) * TIE_FRACTION]
    return min(tied, key=lambda to: _mildness(to[1]) + (round(to[0], 6), to[1].plan.total))[1]


def closest(candidates: list[Option]) -> Optional[Option]:
    """Where nothing fits, the candidate nearest to fitting (least `shortfall`, then the least
    excess on both budgets together, then by CHOICE_RULE); None without candidates."""
    return min(candidates, key=_nearness, default=None)


def _nearness(o: Option) -> tuple:
    """The larger excess first, then both together (over on one budget is nearer than over on
    two), then CHOICE_RULE."""
    return (o.shortfall, sum(o.excess), rank_key(o, o.step_s))


def options(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = int(DEFAULT_HOST_MEMORY_GB * GiB),
    costs: Costs = Costs(),
    strategies: Optional[list[ShardingStrategy]] = None,
    hw: Optional[Hardware] = None,
) -> list[Option]:
    """Every candidate (module docstring): those that fit device and host first, the fastest
    predicted step first (equal ones by CHOICE_RULE); then those that do not, nearest to fitting
    first. strategies: the sharding strategies to try (None: the configured one;
    planner.strategies: every one that differs at this world size; HYBRID_SHARD with every
    shard group of hybrid_groups). hw: what the steps run on (None: default_hardware)."""
    hw = hw or default_hardware(local_world_size, costs)
    out = []
    for cand, snapshots_off in _candidates(cfg, world_size, local_world_size, headroom, strategies):
        p = plan(
            cand,
            world_size,
            device_memory_bytes,
            local_world_size,
            headroom=headroom,
            host_memory_bytes=host_memory_bytes,
        )
        out.append(price(p, cand, snapshots_off, hw))
    fitting = sorted((o for o in out if o.fits), key=lambda o: rank_key(o, o.step_s))
    rest = sorted((o for o in out if not o.fits), key=_nearness)
    return fitting + rest


def cheapest(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    **kwargs,
) -> Optional[Option]:
    """`choose`'s answer among `options` (the same keywords), or None when nothing fits."""
    return choose(options(cfg, world_size, device_memory_bytes, local_world_size, **kwargs))


def best_per_levers(opts: list[Option]) -> list[Option]:
    """For each combination of the device's memory levers (moments, master, offload), its first
    candidate in the order of `opts` (options': the fastest where one fits, else the nearest to
    fitting; put `choose`'s answer first to have its row be the answer): one row per
    combination. Snapshots are not a row of their own: turning them off changes host memory
    only, so a row turns them off only where the host needs it."""
    seen: dict[tuple, Option] = {}
    for o in opts:
        seen.setdefault(o.plan.levers, o)
    return list(seen.values())


def default_hardware(local_world_size: int, costs: Costs = Costs()) -> Hardware:
    """Nodes of `local_world_size` H100s, NVLink inside, 400 Gb/s InfiniBand a GPU between
    (hardware.py), with the PCIe and host rates of `costs`."""
    return hardware(
        "h100",
        local_world_size,
        pcie_gbs=costs.pcie_gbs,
        host_bandwidth_gbs=costs.host_bandwidth_gbs,
    )


def price(p: MemoryPlan, cfg: TrainerConfig, snapshots_off: bool, hw: Hardware) -> Option:
    """A plan with its predicted step (steptime.py) on `hw`."""
    hybrid = p.strategy == "HYBRID_SHARD"
    group = (cfg.sharding.hybrid_shard_group_size or hw.gpus_per_node) if hybrid else 0
    return Option(p, snapshots_off, step_time(cfg, p.world_size, hw), group)


def hybrid_groups(cfg: TrainerConfig, world_size: int, local_world_size: int) -> list[int]:
    """HYBRID_SHARD's shard groups worth trying: a node, and a node x 2, 4, ... while the group
    divides the world and leaves more than one replica (a group of all ranks is FULL_SHARD),
    each one the mesh can cut the context and expert axes from."""
    out, g = [], max(1, local_world_size)
    while g < world_size:
        if world_size % g == 0:
            sharding = dataclasses.replace(
                cfg.sharding, strategy=ShardingStrategy.HYBRID_SHARD, hybrid_shard_group_size=g
            )
            try:
                mesh_shape(
                    sharding,
                    world_size,
                    local_world_size,
                    cfg.model.moe_experts,
                    cfg.train.context_parallel,
                )
                out.append(g)
            except ConfigError:
                pass
        g *= 2
    return out


def micro_batch_choices(cfg: TrainerConfig, world_size: int) -> list[int]:
    """The configured count and every power of two up to rank 0's sequences (more would only
    add padding micro-batches)."""
    data = world_size // cfg.train.context_parallel  # a context group reads the same sequences
    lo, hi = rank_range(cfg.train.global_batch_size, data, 0)
    rows, out, m = max(1, hi - lo), {cfg.train.micro_batches}, 1
    while m <= min(rows, MAX_MICRO_BATCHES):
        out.add(m)
        m *= 2
    return sorted(out)


def _meshes(cfg: TrainerConfig, world_size: int, local_world_size: int, strategies):
    """(strategy, HYBRID_SHARD's shard group or 0 for the configured one) of each mesh to try."""
    configured = cfg.sharding.hybrid_shard_group_size
    for strategy in strategies or [cfg.sharding.strategy]:
        if ShardingStrategy(strategy) is not ShardingStrategy.HYBRID_SHARD or not strategies:
            yield strategy, configured
            continue
        for group in hybrid_groups(cfg, world_size, local_world_size) or [configured]:
            yield strategy, group


def _candidates(
    cfg: TrainerConfig,
    world_size: int,
    local_world_size: int,
    gpu_workers: bool,
    strategies: Optional[list[ShardingStrategy]],
):
    snapshots = (False, True) if cfg.train.snapshots_on(gpu_workers) else (False,)
    for strategy, group in _meshes(cfg, world_size, local_world_size, strategies):
        for micro in micro_batch_choices(cfg, world_size):
            accumulations = (False, True) if micro > 1 else (False,)
            for ac, acc, state, master, offload, snap_off in itertools.product(
                (False, True), accumulations, STATE_DTYPES, MASTER_DTYPES, OFFLOAD_LEVELS, snapshots
            ):
                sharding = dataclasses.replace(
                    cfg.sharding,
                    strategy=strategy,
                    hybrid_shard_group_size=group,
                    activation_checkpointing=ac,
                    sharded_grad_accumulation=acc,
                    master_dtype=master,
                    offload=offload,
                )
                train = dataclasses.replace(
                    cfg.train,
                    micro_batches=micro,
                    **({"snapshot_every": 0} if snap_off else {}),
                )
                optim = dataclasses.replace(cfg.optim, state_dtype=state)
                yield (
                    dataclasses.replace(cfg, sharding=sharding, train=train, optim=optim),
                    snap_off,
                )


def check_fits(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = None,
    costs: Costs = Costs(),
) -> MemoryPlan:
    """The plan, or ConfigError with the breakdown, the strategies that fit and the memory
    levers that would make it fit (cheapest first): call before workers start.

    host_memory_bytes: per node, shared by min(local_world_size, world_size) workers (None: the
    host is not checked, as on a worker that checks only its device). With micro-batches whose
    unsharded gradients do not fit, the plan with sharded gradient accumulation is returned when
    that one fits (same gradients, more reduce-scatter traffic): the caller turns it on
    (trainer/loop.py does, and says so)."""
    kw = dict(headroom=headroom, host_memory_bytes=host_memory_bytes)
    p = plan(cfg, world_size, device_memory_bytes, local_world_size, **kw)
    if p.fits_all:
        return p
    if cfg.train.micro_batches > 1 and not cfg.sharding.sharded_grad_accumulation:
        sharding = dataclasses.replace(cfg.sharding, sharded_grad_accumulation=True)
        alt = plan(
            dataclasses.replace(cfg, sharding=sharding),
            world_size,
            device_memory_bytes,
            local_world_size,
            **kw,
        )
        if alt.fits_all:
            return alt
    opts = options(cfg, world_size, device_memory_bytes, local_world_size, costs=costs, **kw)
    levers = lever_advice(opts)
    if not p.fits:
        strategies = recommend(
            cfg, world_size, device_memory_bytes, local_world_size, headroom=headroom
        )
        raise ConfigError(
            f"invalid config: sharding.strategy={p.strategy} with sharding.activation_"
            f"checkpointing={p.activation_checkpointing} on {world_size} workers needs "
            f"{p.total / GiB:.2f} GiB per worker, more than {usable_memory(p)}; valid: a "
            f"configuration that fits.\n\n{p.table()}\n\n"
            f"{format_recommendation(strategies, p)}\n\n{levers}"
        )
    raise ConfigError(
        f"invalid config: host memory: {p.workers_per_node} workers per node x "
        f"{p.host_per_worker / GiB:.2f} GiB = {p.host_per_node / GiB:.2f} GiB, more than the "
        f"node's {p.host_memory_bytes / GiB:.2f} GiB (host_memory_gb); valid: a configuration "
        f"that fits.\n\n{p.table()}\n\n{levers}"
    )


ADVICE_ROWS = 3


def lever_advice(opts: list[Option]) -> str:
    """The cheapest few combinations of memory levers that fit, as overrides, or that none
    does."""
    fitting = [o for o in best_per_levers(opts) if o.fits][:ADVICE_ROWS]
    if not fitting:
        return (
            "No combination of the memory levers (optim.state_dtype, sharding.master_dtype, "
            "sharding.offload, activation checkpointing, train.micro_batches, "
            "train.snapshot_every) fits: more workers, more device or host memory, a shorter "
            "data.seq_len."
        )
    lines = [
        "Memory levers that make it fit, cheapest first (step-time estimate, python -m "
        "cluster.plan --table for the table):"
    ]
    for o in fitting:
        p = o.plan
        lines.append(
            f"  {' '.join(o.overrides)}\n    device {p.total / GiB:.2f} GiB peak of "
            f"{p.usable / GiB:.2f} usable, host {p.host_per_node / GiB:.1f} GiB per node, "
            f"~{o.step_s:.2f} s per step (+{o.overhead_s:.2f} s over compute)"
        )
    return "\n".join(lines)
