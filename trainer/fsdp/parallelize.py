"""One function from a plain model and a ShardingConfig to the wrapped engine.

    mesh = build_mesh(sharding, rank, world_size, local_world_size)
    fsdp = parallelize(build_model(model_cfg, device="meta"), sharding, mesh, device,
                       init_fn=lambda module, prefix: init_parameters(module, seed, prefix))

In this order: the wrap policy names the units (by default the embedding, one per transformer
block, and the final norm with the output projection; the rest of the model is the root unit);
activation checkpointing wraps each block's forward (the checkpoint policy's modules); the engine
flattens each unit's parameters, materialising meta parameters one at a time through `init_fn`
and keeping only this rank's slice; the sharding config becomes the engine's explicit
arguments. The model file, the loop, the planner, the benchmarks and the tests all build the
engine here and nowhere else.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from .config import ShardingConfig
from .engine import FSDPModel
from .mesh import ShardMesh
from .wrap import InitFn, UnitSpec, block_policy, transformer_policy

WrapPolicy = Callable[[torch.nn.Module], list[UnitSpec]]
"""policy(model) -> the units, in any order: each a module or modules that run in a row; the rest
of the model is the root unit."""


def parallelize(
    model: torch.nn.Module,
    cfg: ShardingConfig,
    mesh: ShardMesh,
    device: torch.device | str,
    init_fn: Optional[InitFn] = None,
    wrap_policy: WrapPolicy = transformer_policy,
    checkpoint_policy: WrapPolicy = block_policy,
) -> FSDPModel:
    """`model` wrapped by our engine on `mesh`, as `cfg` says; its meta parameters (if any)
    materialised on `device` by `init_fn(module, prefix)`. With activation checkpointing the
    modules `checkpoint_policy` names recompute their activations in backward."""
    units = wrap_policy(model)
    if cfg.activation_checkpointing:
        for module in checkpoint_policy(model):
            apply_activation_checkpointing(module)
    return FSDPModel(
        model,
        mesh,
        torch.device(device),
        units=units,
        param_dtype=cfg.param_dtype.torch,
        reduce_dtype=cfg.reduce_dtype.torch,
        reshard_after_forward=cfg.strategy.reshard_after_forward,
        forward_prefetch=cfg.forward_prefetch,
        backward_prefetch=cfg.backward_prefetch,
        max_gathers_in_flight=cfg.max_gathers_in_flight,
        max_reductions_in_flight=cfg.max_reductions_in_flight,
        sharded_grad_accumulation=cfg.sharded_grad_accumulation,
        offload=cfg.offload,
        master_dtype=cfg.master_dtype.torch,
        master_rounding=cfg.master_rounding,
        trace=cfg.trace,
        init_fn=init_fn,
    )


def apply_activation_checkpointing(module: torch.nn.Module) -> None:
    """Recompute `module`'s activations in backward (non-reentrant) instead of keeping them.

    The engine's hooks stay outside the checkpointed region: its pre-backward hook gathers the
    unit's parameters before autograd reruns the forward."""
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
