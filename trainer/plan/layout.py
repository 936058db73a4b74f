"""The exact per-worker layout: the engine itself, wrapped on the meta device over a virtual mesh.

Nothing is re-derived here. `parallelize` builds the engine's units (the embedding, one per
block, the head and the root), flattens and pads every FlatParameter to a multiple of the
shard-group size and creates the optimizer views, all on the meta device, so the 8B model costs
a fraction of a second (after torch's one-time imports) and no memory. We then read the
engine's own numbers: the `sharded_params` it accounts at construction, each flat's
`shard_numel` / `padded_numel`, each unit's `gathered_bytes` and `alias`, and the optimizer views
(AdamW keeps exp_avg and exp_avg_sq, fp32, for exactly those elements: padding has no state).

The virtual mesh has no process groups: nothing communicates at construction.

Frozen parameters (train.freeze) are frozen by the same build, so the engine gives them flats of
their own and the layout reads their cost off it: no gradient shard, no optimizer state, and
(traffic.py, timeline.py read `trainable`) no reduce-scatter and no unsharded gradient; each unit
by its own strategy (sharding.modules) as well.

The engine is always wrapped as planning builds it (fp32 master, nothing offloaded); the memory
levers (optim.state_dtype, sharding.master_dtype, sharding.offload) then price its element counts
with the one table of levers.py, so a lever's figure is corrected there and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from trainer.build import build
from trainer.config import ModelConfig, ShardingConfig, ShardingStrategy, TrainConfig, TrainerConfig
from trainer.fsdp import FSDPModel, Mesh, virtual_mesh
from trainer.fsdp.wrap import ROOT

from .levers import BYTES, state_bytes

ADAM_STATES = (
    2  # exp_avg, exp_avg_sq: one per element of each optimizer view (the step is a scalar)
)


@dataclass(frozen=True)
class UnitLayout:
    """One engine unit as rank `rank` holds it."""

    name: str
    kind: str
    """"embedding", "block", "head" (final norm + output projection), "root", or a vision
    tower's "vision_block" and "vision_merger" (_kind)."""
    padded: tuple[int, ...]  # padded_numel of each FlatParameter
    shard: tuple[int, ...]  # shard_numel of each FlatParameter (same on every rank)
    trainable: tuple[bool, ...]  # requires_grad of each FlatParameter
    gathered_bytes: (
        int  # the unsharded compute-dtype buffers while gathered (0 if the shard is aliased)
    )
    opt_numel: int  # elements this rank keeps optimizer state for (real elements only, no padding)
    shard_size: int = 1  # its placement on the mesh: its own strategy's (sharding.modules)
    replicate_size: int = 1
    reshard_after_forward: bool = False  # frees its gathered parameters after forward
    flat_shard_sizes: tuple[int, ...] = ()
    """Each flat's own shard group (a mixture's experts: the ranks holding the same ones)."""
    flat_replicate_sizes: tuple[int, ...] = ()
    backward: bool = True
    """Its backward runs: it trains, or a gradient flows through it to a unit before it that
    does. A frozen unit with nothing trainable before it (the leading blocks, a frozen vision
    tower) runs none, so the engine never gathers it again after its forward and no
    activations of it are kept (backward_runs)."""


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
    """The non-root units in forward order: a vision tower's blocks and merger (a
    vision-language model runs its tower first), the embedding, the blocks, the head (with tied
    embeddings only the blocks: the embedding and the norm are the root's)."""
    sharded_params: int
    """Device bytes of the parameter shards: the master (as the engine accounts it at
    construction, in sharding.master_dtype), its compute copy (offload=optimizer) or 0
    (offload=params)."""
    sharded_grads: int
    """Device bytes of the gradient shards, in the master's dtype (allocated at the first
    reduction)."""
    optim_state: int
    """Device bytes of AdamW's moments on this rank (optim.state_dtype), with the bf16 master's
    rounding compensation if it keeps one."""
    host_state: int = 0
    """sharding.offload=optimizer|params: the master, gradient shard and AdamW state in host
    memory (the device terms above then hold only the compute-dtype copy of the shard, or
    nothing)."""
    host_staging: int = 0
    """Offloaded: the pinned host buffers the reduced gradient shards are copied into."""
    shard_state: int = 0
    """Master + moments (+ compensation) wherever they are: what one snapshot copies."""
    offload: str = "none"
    shard_elements: int = 0  # P: this rank's shard elements, padding included
    grad_elements: int = 0  # G: elements of the trainable flats' shards
    optim_elements: int = 0  # O: elements with optimizer state (no padding)
    frozen_elements: int = 0
    """Elements of the model that train.freeze froze (each counted once, whole, not sharded)."""

    @property
    def blocks(self) -> tuple[UnitLayout, ...]:
        return tuple(u for u in self.units if u.kind == "block")

    @property
    def all_units(self) -> tuple[UnitLayout, ...]:
        return (self.root, *self.units)

    def index(self, kind: str) -> Optional[int]:
        """Forward position of the first unit of `kind` (None if the model has none)."""
        return next((i for i, u in enumerate(self.units) if u.kind == kind), None)


def meta_engine(
    model: ModelConfig, sharding: ShardingConfig, mesh: Mesh, freeze: tuple[str, ...] = ()
) -> FSDPModel:
    """The engine as trainer/build.py builds it for training, around a meta model: parameters are
    never materialised or initialised, and there is no optimizer (layout prices its state).
    `freeze`: train.freeze, applied by the build as in training."""
    sharding = dataclasses.replace(sharding, trace=False)
    job = TrainerConfig(model=model, sharding=sharding, train=TrainConfig(freeze=list(freeze)))
    return build(job, mesh, "meta", init_fn=lambda module, prefix: None, optimizer=False).model


def layout(
    model: ModelConfig,
    sharding: ShardingConfig,
    world_size: int,
    local_world_size: int = 8,
    rank: int = 0,
    state_dtype: str = "float32",
    context: int = 1,
    freeze: list[str] | tuple[str, ...] = (),
) -> Layout:
    """The layout of `rank` (rank 0 holds the most optimizer state: later ranks hold the
    padding), its state priced under the levers: state_dtype is optim.state_dtype. `context`:
    train.context_parallel, an axis cut from the shard group that parameters are sharded over
    too, so the shards are those of context 1; a degree that does not divide the world (or the
    HYBRID_SHARD group) is the mesh's ConfigError. `freeze`: train.freeze (a pattern naming no
    parameter is its ConfigError)."""
    key = (
        frozen_model(model),
        sharding.strategy,
        sharding.param_dtype,
        sharding.hybrid_shard_group_size,
        tuple(sharding.modules.items()),
        sharding.expert_parallel,
        tuple(freeze),
    )
    base = _layout(key, world_size, local_world_size, rank, context)
    return with_levers(base, sharding, state_dtype)


def with_levers(base: Layout, sharding: ShardingConfig, state_dtype: str) -> Layout:
    """The engine's fp32, on-device layout with the state bytes of the levers (levers.py)."""
    offload = str(sharding.offload)
    b = state_bytes(
        base.shard_elements,
        base.grad_elements,
        base.optim_elements,
        master=str(sharding.master_dtype),
        moments=str(state_dtype),
        rounding=str(sharding.master_rounding),
        offload=offload,
        param_dtype=str(sharding.param_dtype),
        reduce_bytes=sharding.reduce_dtype.itemsize,
    )
    units = base.units
    if offload == "params":  # no shard stays on the device: an aliased unit needs its copy too
        p = BYTES["compute"][str(sharding.param_dtype)]
        units = tuple(_on_device(u, p) for u in units)
    return dataclasses.replace(
        base,
        units=units,
        root=_on_device(base.root, BYTES["compute"][str(sharding.param_dtype)])
        if offload == "params"
        else base.root,
        sharded_params=b.device_params,
        sharded_grads=b.device_grads,
        optim_state=b.device_optim,
        host_state=b.host_state,
        host_staging=b.host_staging,
        shard_state=b.shard_state,
        offload=offload,
    )


def _on_device(u: UnitLayout, param_bytes: int) -> UnitLayout:
    """offload=params: a unit whose shard was its parameter (one rank per shard group, fp32) now
    copies it in from the host, so its gathered bytes are that copy."""
    if u.gathered_bytes or not sum(u.padded):
        return u
    return dataclasses.replace(u, gathered_bytes=param_bytes * sum(u.padded))


@lru_cache(maxsize=64)
def _layout(key, world_size: int, local_world_size: int, rank: int, context: int = 1) -> Layout:
    model_fields, strategy, param_dtype, hybrid, modules, expert_parallel, freeze = key
    model = thawed_model(model_fields)
    sharding = ShardingConfig(
        strategy=strategy,
        param_dtype=param_dtype,
        hybrid_shard_group_size=hybrid,
        modules=dict(modules),
        expert_parallel=expert_parallel,
    )
    mesh = virtual_mesh(sharding, rank, world_size, local_world_size, model.moe_experts, context)
    fsdp = meta_engine(model, sharding, mesh, freeze)
    flats = list(fsdp.flats())
    sharded_params = fsdp.acct.live["sharded_params"]
    # the fp32 gradient shard is allocated like the parameter shard, at the first reduction
    sharded_grads = sum(f.shard.numel() * f.shard.element_size() for f in flats if f.requires_grad)
    optim_state = sum(
        ADAM_STATES * p.numel() * p.element_size() for f in flats for p, _, _ in f.opt_params
    )
    return Layout(
        strategy=sharding.strategy,
        world_size=world_size,
        shard_size=mesh.shard_size,
        replicate_size=mesh.replicate_size,
        rank=rank,
        num_params=fsdp.num_params(),
        root=_unit(fsdp.root),
        units=backward_runs(_unit(fsdp.root), forward_order([_unit(u) for u in fsdp.units])),
        sharded_params=sharded_params,
        sharded_grads=sharded_grads,
        optim_state=optim_state,
        shard_elements=sharded_params // 4,  # the fp32 master the engine accounts
        grad_elements=sum(f.shard.numel() for f in flats if f.requires_grad),
        optim_elements=sum(p.numel() for f in flats for p, _, _ in f.opt_params),
        frozen_elements=sum(f.numel for f in flats if not f.requires_grad),
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
        shard_size=u.placement.shard_size,
        replicate_size=u.placement.replicate_size,
        reshard_after_forward=u.reshard_after_forward,
        flat_shard_sizes=tuple(f.placement.shard_size for f in u.flats),
        flat_replicate_sizes=tuple(f.placement.replicate_size for f in u.flats),
    )


FORWARD = ("vision_block", "vision_merger", "embedding", "block", "head")
"""The order the units' kinds run in forward (trainer/model/multimodal.py: the tower, then the
decoder); the blocks of each kind in the wrap policy's order (their index)."""


def forward_order(units: list[UnitLayout]) -> list[UnitLayout]:
    """The units in forward order (the wrap policy lists a tower's merger after the decoder's
    blocks); a text model's are in it already."""
    return sorted(units, key=lambda u: FORWARD.index(u.kind))


def backward_runs(root: UnitLayout, units: list[UnitLayout]) -> tuple[UnitLayout, ...]:
    """Each unit with `backward` set: whether a gradient reaches it. Through the tower a
    gradient reaches a unit when it or a unit before it trains; the decoder's input (the
    embedding's output, the tower's features scattered in) needs one when the embedding or the
    tower does; the root's parameters (a tower's patch embedding, tied embeddings) run first."""
    tower = decoder = any(root.trainable)
    out = []
    for u in units:
        trains = any(u.trainable)
        if u.kind.startswith("vision"):
            tower = runs = tower or trains
        elif u.kind == "embedding":  # its input is the tokens: a gradient reaches it if it trains
            runs = trains or any(root.trainable)
            decoder = decoder or tower or trains
        else:
            decoder = runs = decoder or tower or trains
        out.append(dataclasses.replace(u, backward=runs))
    return tuple(out)


def _kind(name: str) -> str:
    """The role of a unit of trainer/model by its name (transformer_policy's units)."""
    if name == ROOT:
        return "root"
    if name.startswith("layers."):
        return "block"
    if name.startswith("visual."):
        return "vision_merger" if name.startswith("visual.merger") else "vision_block"
    return "embedding" if name == "tok_embeddings" else "head"


def frozen_model(model: ModelConfig) -> tuple:
    """The model's fields as a hashable cache key (a list field as a tuple, a nested section,
    the vision tower's, as a frozenset of its fields)."""
    fields = dataclasses.asdict(model).items()
    return tuple(sorted((k, _hashable(v)) for k, v in fields))


def _hashable(v):
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, dict):
        return frozenset((k, _hashable(x)) for k, x in v.items())
    return v


def thawed_model(key: tuple) -> ModelConfig:
    """The ModelConfig of frozen_model's key (a nested section as the dict ModelConfig takes)."""
    return ModelConfig(**{k: _thawed(v) for k, v in key})


def _thawed(v):
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, frozenset):
        return {k: _thawed(x) for k, x in v}
    return v
