"""Long sequences: the context degree a job needs, the longest sequence a cluster can train, and
the activation bytes a context degree leaves a worker.

    from trainer.plan.context import activation_bytes, smallest_context, longest_sequence
    activation_bytes(PRESETS["8b"], rows=1, seq_len=65536, context=8)   # bytes per worker
    found = smallest_context(cfg, 8, 80 * 2**30)    # ContextAnswer: degree, its best Option
    longest_sequence(cfg, 8, 80 * 2**30, context=8) # tokens (0: not even the shortest probe)

    python -m cluster.plan model=8b cluster.num_workers=8 data.seq_len=65536 ...

With train.context_parallel = N each worker computes 2c = 2 ceil(T / 2N) tokens of every
sequence its context group reads (trainer/model/context.py): the activations of those tokens,
plus one layer's gathered keys and values of the whole sequence ([rows, T, kv_heads, 2
head_dim], live in that layer's attention, their gradient in its backward) and their copies
repeated over the query heads for each chunk's key range. activations.py measures all of it on
fake tensors; nothing here re-derives it.

The ranks of a context group read the same samples, so the global batch is split over world / N
data ranks: at a fixed global batch a worker gets N x the rows of N x fewer tokens, and the
micro-batch count the planner chooses (train.micro_batches, up to the worker's rows) brings the
rows of a micro-batch back down. The search holds the job's global batch and lets the planner
choose everything else (choose.options), degree by degree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from trainer.config import PRESETS, ModelConfig, ShardingStrategy, TrainerConfig
from trainer.fsdp.mesh import context_problem, divisors

from .activations import profile
from .choose import Option, choose, options
from .hardware import Hardware
from .levers import DEFAULT_HOST_MEMORY_GB, Costs, GiB
from .planner import plan, strategies
from .timeline import activation_peak

SEQUENCE_STEP = 1024
"""The longest sequence is searched in multiples of this many tokens."""
MAX_SEQUENCE = 2**23
"""The search stops here (8M tokens): a bound, not a claim that attention would run there."""


def activation_bytes(
    model: Union[ModelConfig, str],
    rows: int,
    seq_len: int,
    context: int = 1,
    checkpointing: bool = True,
    param_dtype: str = "bfloat16",
    *,
    loss_chunk_tokens: Optional[int] = None,
    device: str = "cuda",
) -> int:
    """The planner's peak of activation memory per worker over one micro-batch's forward and
    backward: `rows` sequences of `seq_len` tokens, each split over `context` workers
    (train.context_parallel), the blocks and the root (embedding, logits, loss) composed over
    the model's layers as the step runs them (timeline.activation_phases). Parameters, their
    flat gradients and the optimizer state are not in it; the gathered K/V and its gradient
    are. `device="cpu"` counts the dense attention masks a CPU worker builds under a split
    (CUDA's block masks are a few KiB). `model`: a ModelConfig or a preset's name."""
    cfg = PRESETS[model] if isinstance(model, str) else model
    acts = profile(
        cfg, rows, seq_len, param_dtype, checkpointing, loss_chunk_tokens, context, device
    )
    return activation_peak(acts, cfg.n_layers)


def context_degrees(cfg: TrainerConfig, world_size: int, local_world_size: int = 8) -> list[int]:
    """The context degrees the planner tries at this world size: the divisors of the world that
    some strategy it tries accepts (HYBRID_SHARD's shard group must be divisible too), with
    2N <= data.seq_len (each rank holds two chunks). Only 1 for a mixture of experts (the
    combination is refused, trainer/config.py)."""
    if cfg.model.moe_experts:
        return [1]
    out = []
    for d in divisors(world_size):
        if 2 * d > cfg.data.seq_len:
            break
        tries = strategies(_at(cfg, d), world_size, local_world_size)
        if any(_accepts(cfg, s, world_size, d, local_world_size) for s in tries):
            out.append(d)
    return out


def _accepts(cfg, strategy, world_size: int, d: int, local_world_size: int) -> bool:
    sharding = dataclasses.replace(cfg.sharding, strategy=strategy)
    return context_problem(sharding, world_size, d, local_world_size) is None


def _at(cfg: TrainerConfig, context: int, seq_len: Optional[int] = None) -> TrainerConfig:
    train = dataclasses.replace(cfg.train, context_parallel=context)
    if seq_len is None:
        return dataclasses.replace(cfg, train=train)
    data = dataclasses.replace(cfg.data, seq_len=seq_len)
    # a longer sequence than the model's own limit: what model.max_seq_len would then be set to
    model = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, seq_len))
    return dataclasses.replace(cfg, train=train, data=data, model=model)


@dataclass(frozen=True)
class ContextAnswer:
    degree: int
    """The smallest train.context_parallel at which some configuration fits (0: none does)."""
    best: Optional[Option]
    """choose's answer at that degree (None when none fits)."""
    tried: tuple[int, ...]
    """The degrees tried, smallest first (context_degrees)."""


def smallest_context(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = int(DEFAULT_HOST_MEMORY_GB * GiB),
    costs: Costs = Costs(),
    hw: Optional[Hardware] = None,
) -> ContextAnswer:
    """The smallest context degree (context_degrees, ascending) at which choose.options finds a
    configuration that fits, and that configuration, ranked by the step time on `hw` (None:
    default_hardware); degree 0 when none does."""
    tried = context_degrees(cfg, world_size, local_world_size)
    for d in tried:
        best = _best(
            _at(cfg, d),
            world_size,
            device_memory_bytes,
            local_world_size,
            headroom,
            host_memory_bytes,
            costs,
            hw,
        )
        if best is not None:
            return ContextAnswer(d, best, tuple(tried))
    return ContextAnswer(0, None, tuple(tried))


def _best(cfg, world_size, device, local, headroom, host, costs, hw) -> Optional[Option]:
    opts = options(
        cfg,
        world_size,
        device,
        local,
        headroom=headroom,
        host_memory_bytes=host,
        costs=costs,
        strategies=_strategies(cfg, world_size, local),
        hw=hw,
    )
    return choose(opts)


def _strategies(cfg: TrainerConfig, world_size: int, local: int) -> list[ShardingStrategy]:
    """planner.strategies (it leaves out a HYBRID_SHARD group the context degree does not
    divide)."""
    return strategies(cfg, world_size, local)


def leanest_fits(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = int(DEFAULT_HOST_MEMORY_GB * GiB),
) -> bool:
    """Whether the job fits in its leanest configurations: activation checkpointing on, one
    sequence per micro-batch where the batch allows (sharded gradient accumulation), bf16
    moments and master, snapshots off, each offload level and every strategy the planner tries.
    Every other candidate of choose.options holds at least as much, so this is whether any
    fits, at a fraction of the cost (the longest-sequence search asks it many times)."""
    from .choose import micro_batch_choices  # noqa: PLC0415

    micro = max(micro_batch_choices(cfg, world_size))
    for strategy in _strategies(cfg, world_size, local_world_size):
        for offload in ("none", "optimizer", "params"):
            sharding = dataclasses.replace(
                cfg.sharding,
                strategy=strategy,
                activation_checkpointing=True,
                sharded_grad_accumulation=micro > 1,
                master_dtype="bfloat16",
                offload=offload,
            )
            train = dataclasses.replace(cfg.train, micro_batches=micro, snapshot_every=0)
            optim = dataclasses.replace(cfg.optim, state_dtype="bfloat16")
            cand = dataclasses.replace(cfg, sharding=sharding, train=train, optim=optim)
            p = plan(
                cand,
                world_size,
                device_memory_bytes,
                local_world_size,
                headroom=headroom,
                host_memory_bytes=host_memory_bytes,
            )
            if p.fits_all:
                return True
    return False


def longest_sequence(
    cfg: TrainerConfig,
    world_size: int,
    device_memory_bytes: int,
    local_world_size: int = 8,
    *,
    context: Optional[int] = None,
    at_least: int = 0,
    headroom: bool = True,
    host_memory_bytes: Optional[int] = int(DEFAULT_HOST_MEMORY_GB * GiB),
) -> int:
    """The longest data.seq_len, a multiple of SEQUENCE_STEP, at which the job (its global batch,
    model and cluster) fits at train.context_parallel=`context` (None: as configured) in some
    configuration (leanest_fits); 0 when not even SEQUENCE_STEP does. Memory grows with the
    sequence, so the search doubles to the first length that does not fit and bisects below it.
    `at_least`: a length known to fit (a smaller degree's answer: a larger degree holds fewer
    tokens), where the doubling starts."""
    d = cfg.train.context_parallel if context is None else context
    kw = dict(headroom=headroom, host_memory_bytes=host_memory_bytes)

    def fits(t: int) -> bool:
        return leanest_fits(_at(cfg, d, t), world_size, device_memory_bytes, local_world_size, **kw)

    step = max(SEQUENCE_STEP, 2 * d)
    lo = max(step, at_least - at_least % step)
    if not fits(lo):
        if lo == step:
            return 0
        hi = lo  # at_least was wrong: search below it
        lo = 0
    else:
        hi = lo * 2
        while hi <= MAX_SEQUENCE and fits(hi):
            lo, hi = hi, hi * 2
        if hi > MAX_SEQUENCE:
            return lo
    # lo fits (or is 0), hi does not: bisect to a multiple of step, about 1/16 of lo's scale
    grain = max(step, (lo // 16) // step * step)
    while hi - lo > grain:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
