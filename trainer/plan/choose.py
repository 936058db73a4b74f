"""The planner chooses: every combination of the memory levers, what each costs a step, the
cheapest that fits the device and the host.

    from trainer.plan.choose import options, cheapest
    best = cheapest(cfg, world_size=8, device_memory_bytes=80 * 2**30)
    best.overrides       # ('optim.state_dtype=bfloat16', 'sharding.offload=optimizer', ...)
    best.step_s          # seconds per step: compute + recompute + PCIe + host step + network

    python -m cluster.plan model=70b cluster.num_workers=8 device_memory_gb=80   # the table
    check_fits(cfg, 8, 80 * 2**30, host_memory_bytes=2**40)  # before workers: or ConfigError

The candidates: activation checkpointing off/on, train.micro_batches (the configured count and
every power of two up to the worker's sequences; with more than one, sharded gradient
accumulation off/on), optim.state_dtype, sharding.master_dtype, sharding.offload none |
optimizer | params, and in-memory snapshots as configured or off (train.snapshot_every=0: a host
memory lever). The strategy and the dtypes of compute and reduction stay as configured.

What a candidate costs is an estimate of its step time (levers.py states each rate):
  compute    flops_per_token x the worker's tokens / compute_tflops (the same for every candidate,
             printed so the overheads read as a fraction of it)
  recompute  with activation checkpointing, each block's forward again: 2 x block parameters +
             the attention's 4 x dim x seq_len FLOPs per token (the PaLM convention, a third of
             trainer/model.flops_per_token's per block) / compute_tflops
  PCIe       the offload's bytes over the worker's link per step / pcie_gbs (not overlapped)
  host step  the offloaded AdamW's host memory traffic / the node's host_bandwidth_gbs shared by
             its workers
  network    the bytes the worker sends per step (traffic.py) / network_gbs: more micro-batches
             gather more often, sharded accumulation reduces every micro-batch
None is taken as overlapped with compute, so the sum is an upper bound. The cheapest fitting
candidate has the least overhead (everything but compute); among equal overheads, the one with
the milder levers (bf16 moments before bf16 master, snapshots kept before snapshots off), then
the fewest bytes on the network, no recomputation, fewer micro-batches and the least memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from trainer.config import STATE_DTYPES, ConfigError, TrainerConfig
from trainer.data import rank_range
from trainer.fsdp.config import Offload
from trainer.model import count_params, flops_per_token

from .levers import DEFAULT_HOST_MEMORY_GB, Costs, GiB
from .planner import MemoryPlan, plan, recommend
from .report import format_recommendation, usable_memory

MASTER_DTYPES = ("float32", "bfloat16")  # sharding.master_dtype's valid values
OFFLOAD_LEVELS = tuple(level.value for level in Offload)
MAX_MICRO_BATCHES = 64

LEVER_WEIGHT = {
    "optim.state_dtype=bfloat16": 1,  # bf16 moments: the update is still computed in fp32
    "sharding.master_dtype=bfloat16": 2,  # bf16 master: rounding keeps small updates, mostly
    "train.snapshot_every=0": 4,  # no in-memory snapshots: a lost node costs the last checkpoint
}
"""How reluctantly a lever with no step-time cost is used: ties on overhead go to the lower sum.
The offload levels are priced in seconds (PCIe, host step) and weigh nothing here."""


@dataclass(frozen=True)
class Option:
    """One candidate configuration, its plan and its step-time estimate."""

    plan: MemoryPlan
    snapshots_off: bool
    """The candidate turns off in-memory snapshots that the config has on."""
    compute_s: float
    recompute_s: float
    pcie_s: float
    host_step_s: float
    network_s: float

    @property
    def overhead_s(self) -> float:
        """What the step spends besides its compute: recomputation, PCIe copies, the host's
        optimizer step and the collectives (none overlapped: an upper bound)."""
        return self.recompute_s + self.pcie_s + self.host_step_s + self.network_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.overhead_s

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
        return self.levers + tuple(out)

    def sort_key(self) -> tuple:
        p = self.plan
        weight = sum(LEVER_WEIGHT.get(lever, 0) for lever in self.levers)
        return (
            round(self.overhead_s, 6),
            weight,
            p.total_bytes_moved,
            p.activation_checkpointing,
            p.micro_batches,  # fewer, larger micro-batches run more efficiently (not priced)
            p.total,
        )


def options(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = int(DEFAULT_HOST_MEMORY_GB * GiB),
    costs: Costs = Costs(),
) -> list[Option]:
    """Every candidate (module docstring), those that fit device and host first, cheapest
    first; then those that do not, least device memory first."""
    out = []
    for cand, snapshots_off in _candidates(cfg, world_size, gpu_workers=headroom):
        p = plan(
            cand,
            world_size,
            device_memory_bytes,
            local_world_size,
            headroom=headroom,
            host_memory_bytes=host_memory_bytes,
        )
        out.append(price(p, cand, snapshots_off, costs))
    fitting = sorted((o for o in out if o.fits), key=Option.sort_key)
    rest = sorted((o for o in out if not o.fits), key=lambda o: (o.plan.total, o.sort_key()))
    return fitting + rest


def cheapest(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    **kwargs,
) -> Optional[Option]:
    """The cheapest candidate that fits the device and the host, or None."""
    first = options(cfg, world_size, device_memory_bytes, local_world_size, **kwargs)[0]
    return first if first.fits else None


def best_per_levers(opts: list[Option]) -> list[Option]:
    """For each combination of memory levers, its cheapest fitting candidate (or, where none
    fits, its smallest): one row per combination, in the order of `options`."""
    seen: dict[tuple, Option] = {}
    for o in opts:
        seen.setdefault(o.levers, o)
    return list(seen.values())


def price(p: MemoryPlan, cfg: TrainerConfig, snapshots_off: bool, costs: Costs) -> Option:
    """The step-time estimate of a plan (module docstring)."""
    model, seq = cfg.model, cfg.data.seq_len
    lo, hi = rank_range(cfg.train.global_batch_size, p.world_size, 0)
    tokens = max(1, hi - lo) * seq
    flops = costs.compute_tflops * 1e12
    compute = flops_per_token(model, seq) * tokens / flops
    recompute = 0.0
    if p.activation_checkpointing:
        embeddings = (1 if model.tie_embeddings else 2) * model.vocab_size * model.dim
        block = (count_params(model) - embeddings - model.dim) / model.n_layers
        attention = 4 * model.n_heads * model.head_size * seq
        recompute = model.n_layers * (2 * block + attention) * tokens / flops
    pcie = p.pcie_bytes / (costs.pcie_gbs * 1e9)
    host_bw = costs.host_bandwidth_gbs * 1e9 / p.workers_per_node
    network = p.total_bytes_moved / (costs.network_gbs * 1e9)
    return Option(p, snapshots_off, compute, recompute, pcie, p.host_step_bytes / host_bw, network)


def micro_batch_choices(cfg: TrainerConfig, world_size: int) -> list[int]:
    """The configured count and every power of two up to rank 0's sequences (more would only
    add padding micro-batches)."""
    lo, hi = rank_range(cfg.train.global_batch_size, world_size, 0)
    rows, out, m = max(1, hi - lo), {cfg.train.micro_batches}, 1
    while m <= min(rows, MAX_MICRO_BATCHES):
        out.add(m)
        m *= 2
    return sorted(out)


def _candidates(cfg: TrainerConfig, world_size: int, gpu_workers: bool):
    snapshots = (False, True) if cfg.train.snapshots_on(gpu_workers) else (False,)
    for micro in micro_batch_choices(cfg, world_size):
        accumulations = (False, True) if micro > 1 else (False,)
        for ac, acc, state, master, offload, snap_off in itertools.product(
            (False, True), accumulations, STATE_DTYPES, MASTER_DTYPES, OFFLOAD_LEVELS, snapshots
        ):
            sharding = dataclasses.replace(
                cfg.sharding,
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
        "cluster.plan for the table):"
    ]
    for o in fitting:
        p = o.plan
        lines.append(
            f"  {' '.join(o.overrides)}\n    device {p.total / GiB:.2f} GiB peak of "
            f"{p.usable / GiB:.2f} usable, host {p.host_per_node / GiB:.1f} GiB per node, "
            f"~{o.step_s:.2f} s per step (+{o.overhead_s:.2f} s over compute)"
        )
    return "\n".join(lines)
