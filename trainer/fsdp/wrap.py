"""Wrapping: a module tree -> FSDP units (one per module the wrap policy names, plus the root),
their parameters flattened into FlatParameters and, from the meta device, materialised one
parameter at a time so that only this rank's slice is ever kept.

After wrapping, every original parameter attribute is gone from its module (the unit sets it to a
view of the gathered flat tensor before each use), and each rank holds only its master shards.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from .accounting import Accounting
from .collectives import Collectives
from .config import Offload, ShardingStrategy
from .flat_param import FlatParameter, ParamInfo
from .mesh import Mesh, Placement
from .unit import FSDPUnit, ReduceFn

ROOT = "root"
UnitSpec = Union[torch.nn.Module, tuple[torch.nn.Module, ...]]
"""What a wrap policy names as one unit: a module, or modules that run one right after the other
in forward (their parameters share the unit's flat parameters)."""
InitFn = Callable[[torch.nn.Module, str], None]
"""init_fn(module, prefix): fill the (just materialised) parameters of `module`, whose fully
qualified names start with `prefix`; must depend only on the names, so every rank agrees."""


def NO_INIT(module: torch.nn.Module, prefix: str) -> None:  # noqa: N802 -- a sentinel
    """init_fn for a model whose shards the caller fills next (from a checkpoint, or Hugging
    Face weights): meta parameters are not materialised at all and the shards stay zero."""
    raise AssertionError("NO_INIT is never called")


def block_policy(model: torch.nn.Module) -> list[torch.nn.Module]:
    """One unit per transformer block (children of a ModuleList `layers`), and per block of a
    vision tower (`visual.blocks`) before them; also the modules that activation checkpointing
    wraps."""
    return [*_blocks(getattr(model, "visual", None), "blocks"), *_blocks(model, "layers")]


def _blocks(module: Optional[torch.nn.Module], name: str) -> list[torch.nn.Module]:
    blocks = getattr(module, name, None)
    return list(blocks) if isinstance(blocks, torch.nn.ModuleList) else []


def transformer_policy(model: torch.nn.Module) -> list[UnitSpec]:
    """The default wrap policy: the token embedding, one unit per block, and the final norm with
    the output projection, each its own unit; the root keeps nothing of its own.

    At 8B the embedding and the output projection are 1.05B parameters: as one root they would
    stay gathered the whole step and be reduced last, with nothing left to hide it. As units,
    each is gathered only around its own forward and backward, and the head's reduction goes
    out as backward starts. The norm belongs with the head: it runs right before it, and a
    root-owned parameter's gradient would only be complete at the very end of backward. With
    tied embeddings (`output` is None: the model's own forward reads the embedding's matrix for
    the head) the embedding and the norm stay in the root."""
    blocks = block_policy(model)
    embedding, norm, output = (
        getattr(model, name, None) for name in ("tok_embeddings", "norm", "output")
    )
    # A vision tower's merger (the 2x2 patch merger: 45M parameters at 7B) is gathered around
    # its own forward too; its patch embedding (1.5M) stays in the root.
    merger = getattr(getattr(model, "visual", None), "merger", None)
    tower = [merger] if isinstance(merger, torch.nn.Module) else []
    if not all(isinstance(m, torch.nn.Module) for m in (embedding, norm, output)):
        return [*blocks, *tower]
    return [embedding, *blocks, *tower, (norm, output)]


def _whole(owners, mod_name: str, p: torch.Tensor) -> tuple:
    """(global shape, global offset) of a parameter this rank holds part of: a module with
    `stacked_experts` holds rows [first, first + rows) of `total` along dim 0."""
    owner = owners[mod_name]
    if not getattr(owner, "stacked_experts", False):
        return None, 0
    row = math.prod(p.shape[1:])
    return (owner.total, *p.shape[1:]), owner.first * row


def unit_modules(spec: UnitSpec) -> tuple[torch.nn.Module, ...]:
    return tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)


class UnitBuilder:
    """Builds the units of one model; everything they share is fixed at construction."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: Mesh,
        device: torch.device,
        comm: Collectives,
        acct: Accounting,
        reduce: ReduceFn,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        init_fn: Optional[InitFn],
        offload: Offload = Offload.none,
        master_dtype: torch.dtype = torch.float32,
    ):
        self.mesh, self.device, self.comm, self.acct = mesh, device, comm, acct
        self.reduce = reduce
        self.offload, self.master_dtype = offload, master_dtype
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.init_fn = init_fn
        self.names = {id(m): n for n, m in model.named_modules()}

    def name(self, spec: UnitSpec) -> str:
        return "+".join(self.names[id(m)] for m in unit_modules(spec))

    def unit(
        self,
        name: str,
        spec: UnitSpec,
        strategy: ShardingStrategy,
        exclude: list[UnitSpec] = (),
        root: bool = False,
    ) -> FSDPUnit:
        """The unit of the parameters of `spec`'s modules, minus those of the units in `exclude`
        (the root excludes the other units), placed on the mesh as `strategy` says. Trainable and
        frozen parameters get separate flats, and so do a mixture's stacked experts (a module
        with `stacked_experts`: they are placed without the expert axis, each rank holding its
        own experts). The `root` never reshards after forward: it is gathered first and backward
        ends with it."""
        placement = self.mesh.placement(strategy)
        excluded = {id(p) for e in exclude for m in unit_modules(e) for p in m.parameters()}
        modules = unit_modules(spec)
        owners, groups, seen = {}, {}, set()
        for mod in (sub for m in modules for sub in m.modules()):
            experts = bool(getattr(mod, "stacked_experts", False))
            for attr, p in list(mod.named_parameters(recurse=False)):
                if id(p) in excluded or id(p) in seen:
                    continue
                seen.add(id(p))
                fqn_mod = self.names[id(mod)]
                owners[fqn_mod] = mod
                groups.setdefault((experts, p.requires_grad), []).append((fqn_mod, attr, p))
        flats = [
            self._flatten(groups[key], owners, key[1], self.mesh.placement(strategy, key[0]))
            for key in ((False, True), (False, False), (True, True), (True, False))
            if key in groups
        ]
        return FSDPUnit(
            name,
            modules,
            flats,
            owners,
            placement,
            self.comm,
            self.acct,
            self.reduce,
            self.param_dtype,
            self.reduce_dtype,
            strategy.reshard_after_forward and not root,
        )

    def _flatten(self, entries, owners, requires_grad: bool, placement: Placement) -> FlatParameter:
        # Matrices (weight decay) first, then the rest: two contiguous regions (see flat_param.py).
        entries = sorted(entries, key=lambda e: e[2].ndim < 2)
        infos, offset = [], 0
        for mod_name, attr, p in entries:
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            infos.append(
                ParamInfo(
                    fqn, mod_name, attr, p.shape, offset, p.ndim >= 2, *_whole(owners, mod_name, p)
                )
            )
            offset += p.numel()
        flat = FlatParameter(
            infos,
            placement,
            requires_grad,
            self.device,
            host=self.offload.host,
            compute_dtype=self.param_dtype,
            master_dtype=self.master_dtype,
            keep_compute=self.offload is Offload.optimizer,
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
