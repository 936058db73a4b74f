"""The engine's configuration: sharding strategy, precision, overlap and activation checkpointing.

Plain dataclasses and enums, torch only, so the engine depends on nothing above it. The training
job (trainer/config.py) holds a `ShardingConfig` as its `sharding` section; Hydra (cluster/) types
the `sharding` group with it; `parallelize` (parallelize.py) turns it into the engine's explicit
arguments. Strings from YAML or from tests are parsed into the enums once, as they are set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NoReturn

import torch


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is valid."""


def fail(key: str, value, valid: str) -> NoReturn:
    raise ConfigError(f"invalid config: {key}={value!r}; valid: {valid}")


class NamedEnum(str, enum.Enum):
    """A str enum that prints as its value (MLflow params, f-strings, JSON all see 'FULL_SHARD')."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value, key: str):
        """The member named `value` (a member passes through); ConfigError naming `key` if none."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            fail(key, value, ", ".join(m.value for m in cls))


class ShardingStrategy(NamedEnum):
    """How parameters, gradients and optimizer state are spread over ranks (names as in FSDP)."""

    FULL_SHARD = "FULL_SHARD"  # shard everything; free gathered params after forward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # shard everything; keep gathered params until backward ends
    NO_SHARD = "NO_SHARD"  # replicate params; all-reduce gradients (DDP)
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD inside a node-sized group, replicate across groups

    @property
    def reshard_after_forward(self) -> bool:
        """Blocks free their gathered parameters after forward and gather again in backward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class Offload(NamedEnum):
    """What lives in host memory instead of on the device."""

    none = "none"
    optimizer = "optimizer"  # master shard, gradient shard and AdamW state; step on the host
    params = "params"  # and the compute-dtype shard too: copied to the device before its gather

    @property
    def host(self) -> bool:
        """The master shard, the gradient shard and the optimizer's state live on the host."""
        return self is not Offload.none


class Rounding(NamedEnum):
    """How a bf16 master shard takes its fp32 update (trainer/fsdp/rounding.py)."""

    stochastic = "stochastic"  # up or down with odds by distance: unbiased, small updates survive
    nearest = "nearest"  # round to nearest even: updates under half an ulp are lost (drift)


class DType(NamedEnum):
    """A floating-point dtype by its torch name: the compute and reduction dtypes."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize


def _module_strategy(pattern, value) -> ShardingStrategy:
    """A sharding.modules value, case-blind; the error names it as the user wrote it."""
    if isinstance(value, str) and value.upper() in ShardingStrategy.__members__:
        value = value.upper()
    return ShardingStrategy.parse(value, f"sharding.modules[{str(pattern)!r}]")


@dataclass
class ShardingConfig:
    """The engine (trainer/fsdp): strategy, precision, overlap and activation checkpointing."""

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    param_dtype: DType = DType.float32
    """Compute dtype of gathered parameters: float32, bfloat16 or float16."""
    reduce_dtype: DType = DType.float32
    """Dtype gradients are reduced in: float32, bfloat16 or float16."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (non-reentrant)."""
    forward_prefetch: bool = True
    """Issue the next unit's all-gather before the current unit computes."""
    backward_prefetch: bool = True
    """Issue the previous unit's all-gather before the current unit's backward."""
    max_gathers_in_flight: int = 1
    """Prefetch depth k: while a unit computes, the all-gathers of the next k units (forward
    or backward order) are issued, and no more. Gathered parameters stay within the root +
    (1 + k) x the largest unit."""
    max_reductions_in_flight: int = 1
    """Bound on gradient reductions issued but not yet folded into the fp32 gradient shards, the
    newest included: the oldest is retired (waited for, its buffers freed) before a newer one is
    issued, so unsharded gradients never pile up. 1 (as FSDP2) hides each reduction behind the
    next unit's backward; more only helps when one unit's backward is shorter than a reduction."""
    sharded_grad_accumulation: bool = False
    """With train.micro_batches > 1: reduce-scatter every micro-batch's gradient into the fp32
    gradient shard instead of keeping the whole model's unsharded gradient (in reduce_dtype)
    until the last micro-batch: 1/N of that memory for micro_batches x the reduce-scatter
    traffic. The planner (python -m cluster.plan) recommends it when the job does not fit
    otherwise."""
    offload: Offload = Offload.none
    """none; optimizer: the master shard, the gradient shard and AdamW's state live in pinned
    host memory and the optimizer steps on the host; the device keeps only a compute-dtype copy
    of its shard (2 bytes per parameter / N in bf16 instead of 16). Each reduced gradient shard
    is copied to the host as it is ready, overlapping the rest of backward. params: as
    optimizer, and no persistent copy on the device at all: each unit's shard is copied in
    (on the gather stream) just before its all-gather and freed after it (0 bytes per
    parameter between gathers; the shard crosses PCIe at every gather)."""
    master_dtype: DType = DType.float32
    """The sharded master parameters the optimizer updates: float32, or bfloat16 (2 bytes a
    parameter instead of 4; the gradient shards are then bfloat16 too, the update is computed
    in fp32 and rounded as master_rounding says)."""
    master_rounding: Rounding = Rounding.stochastic
    """With master_dtype=bfloat16, how each fp32 update is rounded into the bf16 master:
    stochastic (unbiased; the noise is a hash of the seed, the step and the element's global
    index, so any world size gives the same result), or nearest (plain bf16: updates below half
    an ulp are lost; kept for the drift comparison in benchmarks/precision.py)."""
    hybrid_shard_group_size: int = 0
    """HYBRID_SHARD shard-group size; 0 takes LOCAL_WORLD_SIZE (ranks per node)."""
    expert_parallel: int = 1
    """Ranks a mixture of experts' experts are split over (the mesh's `expert` axis): each rank
    holds E / N experts of every sparse layer, and tokens travel to their experts' ranks by an
    all-to-all. N divides the experts and the world size (under HYBRID_SHARD the node). The
    experts' weights are sharded over the ranks holding the same experts, the rest of the model
    over all ranks. 1: every rank holds every expert (plain FSDP over them)."""
    modules: dict[str, str] = field(default_factory=dict)
    """Per-module strategies: module-name pattern (fnmatch, as in named_modules(): `tok_embeddings`,
    `layers.*`, `output`) -> strategy, e.g. {tok_embeddings: NO_SHARD, "layers.*": FULL_SHARD}.
    A unit (the embedding, each block, the final norm with the head) takes the strategy of the
    first pattern that names one of its modules; the others keep `strategy`. A pattern that
    names no unit is refused, naming the units there are. HYBRID_SHARD here needs
    strategy=HYBRID_SHARD (its node-sized groups). Names are case-blind (no_shard = NO_SHARD)."""
    trace: bool = False
    """Record issue/wait of every collective and start/end of every unit (for schedule tests)."""

    def __setattr__(self, name: str, value) -> None:
        # Strings (YAML, tests, `cfg.sharding.strategy = "NO_SHARD"`) become enums as they enter.
        if name == "strategy":
            value = ShardingStrategy.parse(value, "sharding.strategy")
        elif name in ("param_dtype", "reduce_dtype", "master_dtype"):
            value = DType.parse(value, f"sharding.{name}")
        elif name == "offload":
            value = Offload.parse(value, "sharding.offload")
        elif name == "master_rounding":
            value = Rounding.parse(value, "sharding.master_rounding")
        elif name == "modules":
            value = {str(k): _module_strategy(k, v) for k, v in dict(value or {}).items()}
        object.__setattr__(self, name, value)

    def validate(self) -> None:
        if self.master_dtype is DType.float16:
            fail("sharding.master_dtype", str(self.master_dtype), "float32 or bfloat16")
        for key in ("max_gathers_in_flight", "max_reductions_in_flight", "expert_parallel"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                fail(f"sharding.{key}", value, "an integer >= 1")
        for pattern, strategy in self.modules.items():
            if (
                strategy is ShardingStrategy.HYBRID_SHARD
                and self.strategy is not ShardingStrategy.HYBRID_SHARD
            ):
                fail(
                    f"sharding.modules[{pattern!r}]",
                    str(strategy),
                    "FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (HYBRID_SHARD for a module needs "
                    "sharding.strategy=HYBRID_SHARD: its node-sized shard groups)",
                )
        if self.hybrid_shard_group_size < 0:
            fail(
                "sharding.hybrid_shard_group_size",
                self.hybrid_shard_group_size,
                "0 (ranks per node) or a positive divisor of the world size",
            )
