"""Initialisation keyed by name: every parameter drawn from (seed, its fully-qualified name)
alone, so per-unit and whole-model init agree, on any device, in any order.

    init_parameters(model.layers[3], seed, prefix="layers.3.")   # == that slice of the whole
    fsdp = parallelize(model, ..., init_fn=initializer(seed))   # one unit at a time

The rule of each parameter: norm weights (RMSNorm, LayerNorm) are 1, biases 0, and every Linear
or Embedding is normal with the `init_std` it carries (`linear` makes such a Linear); a module's
`init_stds` names a std per parameter (the experts). Stacked experts (a module with `first`:
moe.Experts) draw each expert from (seed, name, its global index), so any cut of the experts
agrees.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .config import ModelConfig
from .norms import RMSNorm


def linear(in_features: int, out_features: int, init_std: float, bias: bool = False) -> nn.Linear:
    """A Linear that carries its own init std (biases start at zero), so init works on any
    sub-module."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.init_std = init_std
    return layer


def residual_std(cfg: ModelConfig) -> float:
    """The init std of a projection that writes into the residual stream (attention's wo, the
    feed-forward's w2): init_std / sqrt(2 n_layers), so the stream's variance stays O(1)."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def init_parameters(
    module: nn.Module, seed: int, prefix: str = "", exclude: Iterable[nn.Module] = ()
) -> None:
    """Fill every parameter of `module` from (seed, prefix + its local name) alone.

    Each parameter gets its own CPU generator seeded with crc32(f"{seed}:{fqn}"), draws in fp32
    on CPU and is copied into place, so the values do not depend on which sub-module is passed,
    the order of calls, the device or the parameter dtype:
    `init_parameters(model.layers[3], s, prefix="layers.3.")` equals that slice of
    `init_parameters(model, s)`. Norm weights are 1; every Linear/Embedding is normal with the
    `init_std` it carries (wo and w2 scaled by 1/sqrt(2 n_layers)). Parameters of the modules in
    `exclude` are skipped (the engine's root unit excludes the blocks, which are separate units).
    Raises if a parameter is still on the meta device or has no init rule.
    """
    skip = {id(p) for m in exclude for p in m.parameters()}
    todo = [
        (prefix + name, p, _init_rule(mod, prefix + name))
        for name, p, mod in _named_params_with_owner(module)
        if id(p) not in skip
    ]
    for fqn, p, _ in todo:
        if p.is_meta:
            raise RuntimeError(
                f"init_parameters: parameter {fqn!r} is on the meta device; "
                "materialise it first (module.to_empty(device=...))"
            )
    owners = {id(p): mod for _, p, mod in _named_params_with_owner(module)}
    with torch.no_grad():
        for fqn, p, std in todo:
            first = getattr(owners[id(p)], "first", None)
            if first is not None:  # stacked experts: one draw per expert, by its global index
                for i in range(p.shape[0]):
                    p[i].copy_(_draw(f"{fqn}[{first + i}]", seed, p.shape[1:], std))
            elif p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                _draw_into(p, fqn, seed, std)  # same values, without a second copy in memory
            else:
                p.copy_(_draw(fqn, seed, p.shape, std))


def initializer(seed: int) -> Callable[[nn.Module, str], None]:
    """init_fn(module, prefix) for the engine (trainer/fsdp.parallelize): it materialises meta
    parameters one module at a time and fills them with `init_parameters` under this seed."""
    return lambda module, prefix: init_parameters(module, seed, prefix)


def _named_params_with_owner(module: nn.Module):
    for mod_name, mod in module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            yield (f"{mod_name}.{p_name}" if mod_name else p_name), p, mod


def _init_rule(owner: nn.Module, fqn: str) -> Optional[float]:
    """None means ones (norm gains), 0.0 zeros (biases); a float is the std of a zero-mean
    normal."""
    if isinstance(owner, (RMSNorm, nn.LayerNorm)):  # the vision tower's LayerNorms have biases
        return 0.0 if fqn.endswith(".bias") else None
    if fqn.endswith(".bias"):
        return 0.0
    stds = getattr(owner, "init_stds", {})
    std = stds.get(fqn.rsplit(".", 1)[-1], getattr(owner, "init_std", None))
    if std is None:
        raise ValueError(
            f"init_parameters: no init rule for {fqn!r} "
            f"(a {type(owner).__name__} without an init_std attribute)"
        )
    return float(std)


def _draw_into(p: torch.Tensor, fqn: str, seed: int, std: Optional[float]) -> None:
    if std is None:
        p.fill_(1.0)
    elif std == 0.0:
        p.zero_()
    else:
        p.normal_(0.0, std, generator=_generator(fqn, seed))


def _generator(fqn: str, seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))


def _draw(fqn: str, seed: int, shape: torch.Size, std: Optional[float]) -> torch.Tensor:
    if std is None:
        return torch.ones(shape)
    if std == 0.0:
        return torch.zeros(shape)
    return torch.empty(shape, dtype=torch.float32).normal_(
        0.0, std, generator=_generator(fqn, seed)
    )
