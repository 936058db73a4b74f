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

import fnmatch
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from .config import ConfigError, ShardingConfig, ShardingStrategy
from .engine import FSDPModel
from .mesh import Mesh
from .wrap import InitFn, UnitSpec, block_policy, transformer_policy, unit_modules

WrapPolicy = Callable[[torch.nn.Module], list[UnitSpec]]
"""policy(model) -> the units, in any order: each a module or modules that run in a row; the rest
of the model is the root unit."""


def parallelize(
    model: torch.nn.Module,
    cfg: ShardingConfig,
    mesh: Mesh,
    device: torch.device | str,
    init_fn: Optional[InitFn] = None,
    wrap_policy: WrapPolicy = transformer_policy,
    checkpoint_policy: WrapPolicy = block_policy,
) -> FSDPModel:
    """`model` wrapped by our engine on `mesh`, as `cfg` says; its meta parameters (if any)
    materialised on `device` by `init_fn(module, prefix)`. With activation checkpointing the
    modules `checkpoint_policy` names recompute their activations in backward."""
    units = wrap_policy(model)
    strategies = unit_strategies(model, units, cfg)
    if cfg.activation_checkpointing:
        for module in checkpoint_policy(model):
            apply_activation_checkpointing(module)
    return FSDPModel(
        model,
        mesh,
        torch.device(device),
        units=units,
        strategies=strategies,
        param_dtype=cfg.param_dtype.torch,
        reduce_dtype=cfg.reduce_dtype.torch,
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


def unit_strategies(
    model: torch.nn.Module, units: list[UnitSpec], cfg: ShardingConfig
) -> list[ShardingStrategy]:
    """Each unit's strategy: that of the first sharding.modules pattern naming one of its
    modules, else sharding.strategy. ConfigError for a pattern that names no unit, listing the
    unit names there are (the strategy is a unit's: a pattern inside a block names no unit)."""
    names = {id(m): n for n, m in model.named_modules()}
    unit_names = [[names[id(m)] for m in unit_modules(spec)] for spec in units]
    used: set[str] = set()
    out = []
    for modules in unit_names:
        strategy = cfg.strategy
        for pattern, s in cfg.modules.items():
            if any(fnmatch.fnmatchcase(n, pattern) for n in modules):
                strategy = s
                used.add(pattern)
                break
        out.append(strategy)
    unused = [p for p in cfg.modules if p not in used]
    if unused:
        raise ConfigError(
            f"invalid config: sharding.modules pattern {unused[0]!r} names no unit of this model; "
            f"valid: patterns over the unit modules {describe_units(unit_names)}"
        )
    return out


def describe_units(unit_names: list[list[str]]) -> str:
    """The unit module names, blocks folded: "tok_embeddings, layers.0 .. layers.3, norm,
    output"."""
    flat = [n for modules in unit_names for n in modules]
    blocks = [n for n in flat if n.startswith("layers.")]
    rest = [n for n in flat if not n.startswith("layers.")]
    if len(blocks) > 2:
        rest.insert(min(1, len(rest)), f"{blocks[0]} .. {blocks[-1]} (layers.*)")
    else:
        rest[min(1, len(rest)) : min(1, len(rest))] = blocks
    return ", ".join(rest) or "(none: the whole model is the root)"


def apply_activation_checkpointing(module: torch.nn.Module) -> None:
    """Recompute `module`'s activations in backward (non-reentrant) instead of keeping them.
    Applied once: a module already checkpointed is left as it is.

    The engine's hooks stay outside the checkpointed region: its pre-backward hook gathers the
    unit's parameters before autograd reruns the forward."""
    if getattr(module, "_checkpointed", False):
        return
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    module._checkpointed = True
