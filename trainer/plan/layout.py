"""The exact per-worker layout: the engine itself, wrapped on the meta device over a virtual mesh.

Nothing is re-derived here. `parallelize` builds the engine's units (the embedding, one per
block, the head and the root), flattens and pads every FlatParameter to a multiple of the
shard-group size and creates the optimizer views, all on the meta device, so the 8B model costs
a fraction of a second (after torch's one-time imports) and no memory. We then read the
engine's own numbers: the `sharded_params` it accounts at construction, each flat's
`shard_numel` / `padded_numel`, each unit's `gathered_bytes` and `alias`, and the optimizer views
(AdamW keeps exp_avg and exp_avg_sq, fp32, for exactly those elements: padding has no state).

The virtual mesh has no process groups: nothing communicates at construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from trainer.config import ModelConfig, ShardingConfig, ShardingStrategy
from trainer.fsdp import FSDPModel, ShardMesh, parallelize, virtual_mesh
from trainer.fsdp.config import Offload
from trainer.fsdp.wrap import ROOT
from trainer.model import build_model

ADAM_STATES = (
    2  # exp_avg, exp_avg_sq: one per element of each optimizer view (the step is a scalar)
)


@dataclass(frozen=True)
class UnitLayout:
    """One engine unit as rank `rank` holds it."""

    name: str
    kind: str  # "embedding", "block", "head" (final norm + output projection) or "root"
    padded: tuple[int, ...]  # padded_numel of each FlatParameter
    shard: tuple[int, ...]  # shard_numel of each FlatParameter (same on every rank)
    trainable: tuple[bool, ...]  # requires_grad of each FlatParameter
    gathered_bytes: (
        int  # the unsharded compute-dtype buffers while gathered (0 if the shard is aliased)
    )
    opt_numel: int  # elements this rank keeps optimizer state for (real elements only, no padding)


@dataclass(frozen=True)
class Layout:
    strategy: ShardingStrategy
    world_size: int
    shard_size: int
    replicate_size: int
    rank: int
    num_params: int
    root: UnitLayout
    units: tuple[UnitLayout, ...]
    """The non-root units in forward order: the embedding, the blocks, the head (with tied
    embeddings only the blocks: the embedding and the norm are the root's)."""
    sharded_params: int  # bytes, as the engine accounts them at construction
    sharded_grads: int  # bytes of the fp32 gradient shards (allocated at the first reduction)
    optim_state: int  # bytes of AdamW state on this rank
    host_state: int = 0
    """sharding.offload=optimizer: the fp32 master, gradient shard and AdamW state, in host
    memory (the device terms above then hold only the compute-dtype copy of the shard)."""

    @property
    def blocks(self) -> tuple[UnitLayout, ...]:
        return tuple(u for u in self.units if u.kind == "block")

    @property
    def all_units(self) -> tuple[UnitLayout, ...]:
        return (self.root, *self.units)

    def index(self, kind: str) -> Optional[int]:
        """Forward position of the first unit of `kind` (None if the model has none)."""
        return next((i for i, u in enumerate(self.units) if u.kind == kind), None)


def meta_engine(model: ModelConfig, sharding: ShardingConfig, mesh: ShardMesh) -> FSDPModel:
    """The engine wrapped around a meta model; parameters are never materialised or initialised."""
    sharding = dataclasses.replace(sharding, trace=False)
    return parallelize(
        build_model(model, device="meta"),
        sharding,
        mesh,
        torch.device("meta"),
        init_fn=lambda module, prefix: None,
    )


def layout(
    model: ModelConfig,
    sharding: ShardingConfig,
    world_size: int,
    local_world_size: int = 8,
    rank: int = 0,
) -> Layout:
    """The layout of `rank` (rank 0 holds the most optimizer state: later ranks hold the
    padding)."""
    key = (
        _frozen(model),
        sharding.strategy,
        sharding.param_dtype,
        sharding.hybrid_shard_group_size,
        sharding.offload,
    )
    return _layout(key, world_size, local_world_size, rank)


@lru_cache(maxsize=64)
def _layout(key, world_size: int, local_world_size: int, rank: int) -> Layout:
    model_fields, strategy, param_dtype, hybrid, offload = key
    model = ModelConfig(**dict(model_fields))
    sharding = ShardingConfig(
        strategy=strategy, param_dtype=param_dtype, hybrid_shard_group_size=hybrid
    )
    mesh = virtual_mesh(sharding, rank, world_size, local_world_size)
    fsdp = meta_engine(model, sharding, mesh)
    flats = list(fsdp.flats())
    sharded_params = fsdp.acct.live["sharded_params"]
    # the fp32 gradient shard is allocated like the parameter shard, at the first reduction
    sharded_grads = sum(f.shard.numel() * f.shard.element_size() for f in flats if f.requires_grad)
    optim_state = sum(
        ADAM_STATES * p.numel() * p.element_size() for f in flats for p, _, _ in f.opt_params
    )
    host = 0
    if offload is Offload.optimizer:  # built without (its shards would be real host memory)
        host = sharded_params + sharded_grads + optim_state
        sharded_params = sharded_params // 4 * sharding.param_dtype.itemsize  # the compute copy
        sharded_grads = optim_state = 0
    return Layout(
        strategy=sharding.strategy,
        world_size=world_size,
        shard_size=mesh.shard_size,
        replicate_size=mesh.replicate_size,
        rank=rank,
        num_params=fsdp.num_params(),
        root=_unit(fsdp.root),
        units=tuple(_unit(u) for u in fsdp.units),
        sharded_params=sharded_params,
        sharded_grads=sharded_grads,
        optim_state=optim_state,
        host_state=host,
    )


def _unit(u) -> UnitLayout:
    views = [p.numel() for f in u.flats for p, _, _ in f.opt_params]
    return UnitLayout(
        name=u.name,
        kind=_kind(u.name),
        padded=tuple(f.padded_numel for f in u.flats),
        shard=tuple(f.shard_numel for f in u.flats),
        trainable=tuple(f.requires_grad for f in u.flats),
        gathered_bytes=0 if u.alias else u.gathered_bytes,
        opt_numel=sum(views),
    )


def _kind(name: str) -> str:
    """The role of a unit of trainer/model.py by its name (transformer_policy's units)."""
    if name == ROOT:
        return "root"
    if name.startswith("layers."):
        return "block"
    return "embedding" if name == "tok_embeddings" else "head"


def _frozen(model: ModelConfig) -> tuple:
    return tuple(sorted(dataclasses.asdict(model).items()))
