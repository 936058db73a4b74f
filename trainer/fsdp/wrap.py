"""Wrapping: a module tree -> FSDP units (one per module the wrap policy names, plus the root),
their parameters flattened into FlatParameters and, from the meta device, materialised one
parameter at a time so that only this rank's slice is ever kept.

After wrapping, every original parameter attribute is gone from its module (the unit sets it to a
view of the gathered flat tensor before each use), and each rank holds only its fp32 shards.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .accounting import Accounting
from .collectives import Collectives
from .flat_param import FlatParameter, ParamInfo
from .mesh import ShardMesh
from .unit import FSDPUnit

ROOT = "root"
InitFn = Callable[[torch.nn.Module, str], None]
"""init_fn(module, prefix): fill the (just materialised) parameters of `module`, whose fully
qualified names start with `prefix`; must depend only on the names, so every rank agrees."""


def NO_INIT(module: torch.nn.Module, prefix: str) -> None:  # noqa: N802 -- a sentinel
    """init_fn for a model whose shards the caller fills next (from a checkpoint, or Hugging
    Face weights): meta parameters are not materialised at all and the shards stay zero."""
    raise AssertionError("NO_INIT is never called")


def block_policy(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Default wrap policy: one unit per transformer block (children of a ModuleList `layers`)."""
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class UnitBuilder:
    """Builds the units of one model; everything they share is fixed at construction."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: ShardMesh,
        device: torch.device,
        comm: Collectives,
        acct: Accounting,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        init_fn: Optional[InitFn],
    ):
        self.mesh, self.device, self.comm, self.acct = mesh, device, comm, acct
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.init_fn = init_fn
        self.names = {id(m): n for n, m in model.named_modules()}

    def unit(
        self,
        name: str,
        module: torch.nn.Module,
        reshard_after_forward: bool,
        exclude: list[torch.nn.Module] = (),
    ) -> FSDPUnit:
        """The unit of `module`'s parameters, minus those of the modules in `exclude` (the root
        excludes the other units). Trainable and frozen parameters get separate flats."""
        excluded = {id(p) for m in exclude for p in m.parameters()}
        owners, trainable, frozen, seen = {}, [], [], set()
        for mod in module.modules():
            for attr, p in list(mod.named_parameters(recurse=False)):
                if id(p) in excluded or id(p) in seen:
                    continue
                seen.add(id(p))
                fqn_mod = self.names[id(mod)]
                owners[fqn_mod] = mod
                entry = (fqn_mod, attr, p)
                (trainable if p.requires_grad else frozen).append(entry)
        flats = [
            self._flatten(entries, owners, rg)
            for entries, rg in ((trainable, True), (frozen, False))
            if entries
        ]
        return FSDPUnit(
            name,
            module,
            flats,
            owners,
            self.mesh,
            self.comm,
            self.acct,
            self.param_dtype,
            self.reduce_dtype,
            reshard_after_forward,
        )

    def _flatten(self, entries, owners, requires_grad: bool) -> FlatParameter:
        # Matrices (weight decay) first, then the rest: two contiguous regions (see flat_param.py).
        entries = sorted(entries, key=lambda e: e[2].ndim < 2)
        infos, offset = [], 0
        for mod_name, attr, p in entries:
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            infos.append(ParamInfo(fqn, mod_name, attr, p.shape, offset, p.ndim >= 2))
            offset += p.numel()
        flat = FlatParameter(
            infos, self.mesh.shard_size, self.mesh.shard_rank, requires_grad, self.device
        )
        # One parameter at a time: materialise it, copy the slice this rank owns, drop it. Peak
        # memory is the shard plus the largest single parameter, never the unit or the model.
        for (mod_name, attr, p), info in zip(entries, infos):
            if p.is_meta and self.init_fn is NO_INIT:
                delattr(owners[mod_name], attr)
                continue
            value = self._materialize(owners[mod_name], mod_name, attr, p)
            a, b = max(info.offset, flat.lo), min(info.offset + info.numel, flat.hi)
            if a < b:
                flat.shard[a - flat.lo : b - flat.lo].copy_(
                    value.reshape(-1)[a - info.offset : b - info.offset]
                )
            del value  # no view of it may survive: its storage must go before the next one
            delattr(owners[mod_name], attr)  # the attribute becomes a plain tensor view at unshard
        return flat

    def _materialize(self, owner, mod_name, attr, p) -> torch.Tensor:
        """The initial value of one original parameter, built on this rank only for its unit.

        Meta parameters are materialised one owner module at a time and initialised by `init_fn`,
        which is keyed by parameter name, so every rank computes the same values and a model that
        does not fit on one rank is never whole anywhere."""
        if not p.is_meta:
            return p.detach()
        if self.init_fn is None:
            raise ValueError(
                f"parameter {mod_name}.{attr} is on the meta device; pass init_fn to initialise it"
            )
        if getattr(owner, "_fsdp_materialized", False) is False:
            owner.to_empty(device=self.device, recurse=False)
            self.init_fn(owner, f"{mod_name}." if mod_name else "")
            owner._fsdp_materialized = True
        return getattr(owner, attr).detach()
