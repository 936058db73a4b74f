"""One build: the model, the engine around it, the optimizer and the loss scaler, from the job's
config and the mesh. The loop, the benchmarks (engine, gpu_check, precision) and the planner all
build here, so what is measured and what is planned is what trains.

    mesh = build_mesh(cfg.sharding, rank, world_size, local_world_size)
    built = build(cfg, mesh, device, init_fn=initializer(cfg.train.seed))
    built.model, built.optimizer, built.scaler, built.speed

In this order, torchtitan's (parallelize_llama: quantise, checkpoint, compile, shard), each step
on the plain model, still on the meta device:
0. Freezing (train.freeze, trainer/freeze.py): requires_grad_(False) on the parameters the
   patterns name. First, so that every step after sees which parameters train: the engine puts
   the frozen ones in flats of their own (no gradient, no reduce-scatter, no optimizer state).
   Float8 keeps a weight's requires_grad when it swaps the layer.
1. Float8 (train.float8): the blocks' nn.Linear become torchao's Float8Linear. First, because
   everything after wraps or traces the layers it creates.
2. Activation checkpointing (sharding.activation_checkpointing): each block's forward is wrapped
   in a non-reentrant checkpoint.
3. Compile (train.compile): each block's forward, the checkpoint included, compiled in place. The
   compiler sees the checkpoint as one region (a higher-order op), so the recomputation in
   backward is part of the compiled backward graph and is fused with it; the reverse order (the
   checkpoint around a compiled forward) reruns the compiled forward as a separate graph.
4. Sharding (parallelize): the units, each placed on the mesh by its strategy; the engine's
   hooks sit on the block modules, outside the compiled and checkpointed forward, so the next
   unit's all-gather overlaps the compiled block and the pre-backward gather precedes the
   recomputation.
Then the optimizer over the engine's flat shards and the fp16 loss scaler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from trainer.config import DType, TrainerConfig
from trainer.freeze import Frozen, freeze
from trainer.fsdp import FSDPModel, Mesh, parallelize
from trainer.fsdp.mixed_precision import ShardedGradScaler
from trainer.fsdp.parallelize import apply_activation_checkpointing, unit_strategies
from trainer.fsdp.wrap import InitFn, block_policy, transformer_policy
from trainer.model import build_model
from trainer.optim import build_optimizer

if TYPE_CHECKING:
    from trainer.speed import SpeedInfo


@dataclass
class Built:
    """What `build` returns: everything a step needs."""

    model: FSDPModel
    optimizer: Optional[torch.optim.Optimizer]
    """None when built without one (the planner)."""
    scaler: ShardedGradScaler
    speed: Optional["SpeedInfo"]
    """What train.compile and train.float8 did (None when neither is on)."""
    frozen: Optional[Frozen] = None
    """What train.freeze froze (None when it is empty); `frozen.describe()` is the log line."""


def build(
    cfg: TrainerConfig,
    mesh: Mesh,
    device: torch.device | str,
    init_fn: Optional[InitFn],
    *,
    compile_backend: str = "inductor",
    optimizer: bool = True,
) -> Built:
    """Model, engine, optimizer and scaler of `cfg` on `mesh` (see the module docstring for the
    order). `init_fn` fills meta parameters as they are materialised (trainer.model.initializer,
    or NO_INIT when a checkpoint or Hugging Face weights fill the shards next). `compile_backend`:
    torch.compile's (tests use aot_eager). `optimizer=False`: none (the planner's meta build)."""
    device = torch.device(device)
    model = build_model(cfg.model, device="meta")
    frozen = freeze(model, cfg.train.freeze) if cfg.train.freeze else None
    speed = apply_levers(model, cfg, device, compile_backend)
    fsdp = parallelize(model, cfg.sharding, mesh, device, init_fn=init_fn)
    return Built(
        model=fsdp,
        optimizer=build_optimizer(fsdp, cfg.optim, seed=cfg.train.seed) if optimizer else None,
        scaler=ShardedGradScaler(enabled=cfg.sharding.param_dtype is DType.float16),
        speed=speed,
        frozen=frozen,
    )


def check_module_strategies(cfg: TrainerConfig) -> None:
    """sharding.modules against the model's units, before any worker starts: a ConfigError for
    a pattern that names no unit (listing those there are). On the meta device: no memory."""
    if cfg.sharding.modules:
        model = build_model(cfg.model, device="meta")
        unit_strategies(model, transformer_policy(model), cfg.sharding)


def check_freeze(cfg: TrainerConfig) -> Frozen:
    """train.freeze against the model's parameters, before any worker starts: a ConfigError for
    a pattern that names no parameter (listing the top-level modules); else what it freezes.
    On the meta device: no memory."""
    return freeze(build_model(cfg.model, device="meta"), cfg.train.freeze)


def apply_levers(
    model: torch.nn.Module, cfg: TrainerConfig, device: torch.device, backend: str
) -> Optional["SpeedInfo"]:
    """Float8, activation checkpointing and compile on the plain model, in that order (the
    module docstring says why). Returns what the speed levers did (None when neither is on)."""
    t = cfg.train
    checkpoint = checkpoint_blocks if cfg.sharding.activation_checkpointing else None
    if not (t.compile or t.float8):
        if checkpoint is not None:
            checkpoint(model)
        return None
    from trainer.speed import apply_speed_levers  # noqa: PLC0415 -- torch._dynamo: 1 s to import

    planning = device.type == "meta"  # the planner: Float8's device check needs a real one
    return apply_speed_levers(model, t, None if planning else device, backend, checkpoint)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Activation checkpointing on every block (the modules block_policy names)."""
    for block in block_policy(model):
        apply_activation_checkpointing(block)
