"""The device mesh: every rank a coordinate on named axes whose sizes multiply to the world size,
and the placement of a unit's flat parameters on it.

    mesh = build_mesh(sharding, rank, world_size, local_world_size)   # collective
    mesh.size("shard"), mesh.coord("replicate"), mesh.group("replicate", "shard")
    place = mesh.placement(ShardingStrategy.NO_SHARD)  # where one unit's flats lie

Axes, outermost first (ranks are laid out row-major: the last axis is the fastest, so a node's
consecutive ranks share every axis but the inner ones):

| axis      | splits                          | size                                           |
|-----------|---------------------------------|------------------------------------------------|
| replicate | the data (HYBRID: across nodes) | W / shard under HYBRID_SHARD, W under NO_SHARD |
| shard     | the data and the parameters     | W (FULL_SHARD, SHARD_GRAD_OP), a node (HYBRID) |
| expert    | the data and a mixture's experts | sharding.expert_parallel, cut from shard (*)  |
| context   | each sequence (its tokens)      | train.context_parallel, cut from shard (*)     |

(*) From replicate under NO_SHARD. At a resize to a world it does not divide, the expert axis
takes the largest degree below it dividing both the ranks and the experts (expert_degree, said in
the log line); the context axis is never re-planned (a ConfigError names the valid degrees: a
different degree would be a different sequence split, which the job fixed).

`context` is innermost: a context group is consecutive ranks (inside a node, where the per-layer
K/V all-gather runs). It splits the tokens, not the samples: the ranks of one context group read
the same samples (`data_rank`, `data_size` leave it out), and parameters are sharded over it as
over the data axes (torchtitan's dp_shard_cp), gradients reduce-scattered over the same group.
The tensor axis takes its place after `context` when it lands (docs/engine.md, "The mesh"). A
strategy is a shape of the mesh (mesh_plan) and, per unit, a placement: which
axes the unit's flat parameters are sharded over (all-gather, reduce-scatter) and which they are
replicated over (all-reduce of the shards):

| unit strategy             | sharded over          | replicated over        |
|---------------------------|-----------------------|------------------------|
| FULL_SHARD, SHARD_GRAD_OP | every axis            | -                      |
| HYBRID_SHARD              | shard x expert x context | replicate           |
| NO_SHARD                  | -                     | every axis             |

So FULL_SHARD on a HYBRID_SHARD mesh (sharding.modules) shards over all ranks, and NO_SHARD on a
FULL_SHARD mesh replicates over all ranks. A group over several axes (a FULL_SHARD unit's
replicate x shard) is built once per set of axes and cached.

Expert flats (a mixture of experts' stacked weights, trainer/fsdp/experts.py) are placed the
same way without the `expert` axis: a rank holds only its experts (E / expert_parallel of
them), sharded over the ranks that hold the same ones; ranks of other expert coordinates hold
other experts (`distinct_axes`: what the global norm sums over), not replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from .config import ConfigError, ShardingConfig, ShardingStrategy

AXES = ("replicate", "shard", "expert", "context")
"""The mesh's axes in rank order, outermost first (a node's consecutive ranks differ on the inner
ones: an expert group or a context group is consecutive ranks, its exchange inside a node)."""
DATA_AXES = ("replicate", "shard", "expert")
"""The axes the samples are split over (each rank of them reads its own samples); the context
axis splits each sample's tokens instead."""
PARAM_AXES = (*DATA_AXES, "context")
"""The axes a parameter may be sharded or replicated over: all of them."""


def hybrid_group_size(world_size: int, requested: int, local_world_size: int) -> tuple[int, str]:
    """HYBRID_SHARD's shard group at `world_size` and why: the configured size (or the ranks per
    node) when it divides the world; else, after a resize to a world it does not divide, the
    largest divisor of the world below it (a smaller group still keeps its gathers inside a
    node), said in the log line."""
    size = requested or local_world_size or 1
    source = "sharding.hybrid_shard_group_size" if requested else "ranks per node"
    if world_size % size == 0:
        return size, f"shard groups of {size} ({source})"
    fit = max(d for d in range(1, min(size, world_size) + 1) if world_size % d == 0)
    return fit, (
        f"shard groups of {fit}: {size} ({source}) does not divide world size {world_size}; "
        f"{fit} is the largest divisor of it below {size}"
    )


def mesh_plan(
    cfg: ShardingConfig,
    world_size: int,
    local_world_size: int = 1,
    experts: int = 0,
    context: int = 1,
) -> tuple[dict[str, int], str]:
    """The size of every axis of `cfg`'s mesh at `world_size` (in AXES order; they multiply to
    the world size), and one line saying why. The one place a world size becomes a mesh: the
    engine, the planner and the elastic re-plan at a resize all ask here. `experts`: a
    mixture's experts per sparse layer (0: dense), what the expert axis must divide; `context`:
    train.context_parallel, cut from the shard axis (replicate under NO_SHARD)."""
    shape, why = _data_plan(cfg, world_size, local_world_size, experts, context)
    if context > 1:
        shape["context"] = context
        why += f", each sequence over {context} ranks (train.context_parallel)"
    else:
        shape["context"] = 1
    return shape, why


def context_problem(
    cfg: ShardingConfig, world_size: int, context: int, local_world_size: int = 1
) -> Optional[str]:
    """Why train.context_parallel=`context` cannot split a world of `world_size` (None: it can):
    it must divide the ranks it is cut from (the world; under HYBRID_SHARD its shard group)."""
    if context <= 1:
        return None
    if cfg.strategy is ShardingStrategy.HYBRID_SHARD:
        group, _ = hybrid_group_size(world_size, cfg.hybrid_shard_group_size, local_world_size)
        where = f"the HYBRID_SHARD shard group of {group} ranks"
    else:
        group, where = world_size, f"the world size {world_size}"
    if group % context == 0:
        return None
    valid = ", ".join(str(d) for d in divisors(group))
    other = "shard group" if cfg.strategy is ShardingStrategy.HYBRID_SHARD else "world size"
    return (
        f"invalid config: train.context_parallel={context} does not divide {where}; valid: "
        f"{valid} (or a {other} that {context} divides)"
    )


def _data_plan(
    cfg: ShardingConfig, world_size: int, local_world_size: int, experts: int, context: int
) -> tuple[dict[str, int], str]:
    problem = context_problem(cfg, world_size, context, local_world_size)
    if problem:
        raise ConfigError(problem)
    strategy = cfg.strategy
    why = f"{strategy} over {world_size} rank{'s' if world_size > 1 else ''}"
    if strategy is ShardingStrategy.NO_SHARD:
        shard = 1
    elif strategy is ShardingStrategy.HYBRID_SHARD:
        shard, groups = hybrid_group_size(world_size, cfg.hybrid_shard_group_size, local_world_size)
        why = f"{strategy}, {groups}"
    else:
        shard = world_size
    replicate = world_size // shard
    if context > 1:  # cut from the shard axis (from replicate under NO_SHARD)
        if shard > 1:
            shard //= context
        else:
            replicate //= context
    if cfg.expert_parallel > 1:  # cut from the shard axis (from replicate under NO_SHARD)
        group = shard if shard > 1 else replicate
        ep, degree = expert_degree(cfg.expert_parallel, group, experts)
        if shard > 1:
            shard //= ep
        else:
            replicate //= ep
        why += f", {degree}"
        return {"replicate": replicate, "shard": shard, "expert": ep}, why
    return {"replicate": replicate, "shard": shard, "expert": 1}, why


def expert_degree(requested: int, group: int, experts: int = 0) -> tuple[int, str]:
    """The expert axis cut from a group of `group` ranks and why: sharding.expert_parallel when
    it divides the group (and the `experts`); else, after a resize to a world it does not
    divide, the largest degree below it that divides both (a checkpoint names experts by their
    global index, so any degree resumes it), said in the log line. A degree that does not divide
    the experts is a config error at any world size."""
    if experts and experts % requested:
        raise ConfigError(
            f"invalid config: sharding.expert_parallel={requested} does not divide the model's "
            f"{experts} experts; valid: {', '.join(map(str, divisors(experts)))}"
        )
    if group % requested == 0:
        return requested, f"experts over {requested} ranks (sharding.expert_parallel)"
    fit = max(
        d for d in range(1, requested + 1) if group % d == 0 and (not experts or experts % d == 0)
    )
    return fit, (
        f"experts over {fit} rank{'s' if fit > 1 else ''}: sharding.expert_parallel={requested} "
        f"does not divide the {group} ranks they are cut from; {fit} is the largest degree below "
        f"it dividing both them{f' and the {experts} experts' if experts else ''}"
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shape(
    cfg: ShardingConfig,
    world_size: int,
    local_world_size: int = 1,
    experts: int = 0,
    context: int = 1,
) -> dict[str, int]:
    """mesh_plan's sizes alone."""
    return mesh_plan(cfg, world_size, local_world_size, experts, context)[0]


@dataclass(frozen=True)
class Placement:
    """Where one unit's flat parameters lie: sharded 1/shard_size over the `shard_axes` (this
    rank holds slice `shard_rank`), identical over the `replicate_axes` (this rank is replica
    `replicate_rank`). Groups are None where they would hold one rank, or on a virtual mesh."""

    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    shard_size: int
    shard_rank: int
    shard_group: Optional[dist.ProcessGroup]
    replicate_size: int
    replicate_rank: int
    replicate_group: Optional[dist.ProcessGroup]
    shard_ranks: tuple[int, ...]
    """The global ranks of this rank's shard group, by shard rank."""
    distinct_axes: tuple[str, ...] = ()
    """The axes over which ranks hold different elements (what a global norm sums over): the
    shard axes, and for expert flats the expert axis too (other ranks, other experts)."""
    distinct_group: Optional[dist.ProcessGroup] = None
    distinct_size: int = 1
    expert_group: Optional[dist.ProcessGroup] = None
    """Expert flats: the ranks holding the other experts (the expert axis); None for dense."""
    expert_size: int = 1

    @property
    def primary(self) -> bool:
        """This rank's copy is the one that is saved and sent (replicas hold the same bytes)."""
        return self.replicate_rank == 0

    @property
    def hybrid(self) -> bool:
        """Shards reduced inside the shard group, then all-reduced across replicas."""
        return self.shard_size > 1 and self.replicate_size > 1


@dataclass
class Mesh:
    """This rank's place on the named axes, and the process groups over any set of them."""

    rank: int
    world_size: int
    shape: dict[str, int]
    """Axis name -> size, outermost first."""
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """The strategy of units without one of their own (sharding.strategy)."""
    virtual: bool = False
    """Planning on the meta device: no process group is ever created."""
    why: str = ""
    """How the strategy and the world size gave this shape (mesh_plan)."""
    _groups: dict = field(default_factory=dict, repr=False)
    _placements: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if math.prod(self.shape.values()) != self.world_size:
            raise ValueError(f"mesh {self.shape} does not multiply to world size {self.world_size}")

    # ---- coordinates -------------------------------------------------------------------
    def size(self, *axes: str) -> int:
        return math.prod(self.shape[a] for a in axes)

    def coords(self, rank: Optional[int] = None) -> dict[str, int]:
        """Every axis's coordinate of `rank` (this rank by default)."""
        rest, out = self.rank if rank is None else rank, {}
        for name in reversed(self.shape):  # the last axis is the fastest
            rest, out[name] = divmod(rest, self.shape[name])
        return {name: out[name] for name in self.shape}

    def coord(self, *axes: str) -> int:
        """This rank's coordinate on `axes` flattened (row-major, in mesh order)."""
        c = self.coords()
        index = 0
        for name in self._ordered(axes):
            index = index * self.shape[name] + c[name]
        return index

    def group_ranks(self, *axes: str, rank: Optional[int] = None) -> list[int]:
        """The global ranks that share every coordinate of `rank` but those on `axes`, by their
        flattened coordinate on `axes`."""
        axes = self._ordered(axes)
        fixed = self.coords(rank)
        ranks = []
        for i in range(self.size(*axes)):
            c, rest = dict(fixed), i
            for name in reversed(axes):
                rest, c[name] = divmod(rest, self.shape[name])
            ranks.append(self._rank_of(c))
        return ranks

    def _rank_of(self, coords: dict[str, int]) -> int:
        r = 0
        for name, size in self.shape.items():
            r = r * size + coords[name]
        return r

    def _ordered(self, axes) -> tuple[str, ...]:
        unknown = [a for a in axes if a not in self.shape]
        if unknown:
            raise ValueError(f"mesh axes {unknown} unknown; the mesh has {list(self.shape)}")
        return tuple(a for a in self.shape if a in axes)

    # ---- groups ------------------------------------------------------------------------
    def group(self, *axes: str) -> Optional[dist.ProcessGroup]:
        """The process group over `axes` that this rank belongs to: None when it holds one rank
        (or the mesh is virtual), the default group when it holds all of them.

        Collective the first time a set of axes is asked for: torch creates groups on every rank
        together, so every rank creates all the groups over `axes` (one per coordinate of the
        other axes), in the same order. The engine asks in unit order, the same on every rank."""
        axes = self._ordered(axes)
        if axes not in self._groups:
            self._groups[axes] = self._new_group(axes)
        return self._groups[axes]

    def _new_group(self, axes: tuple[str, ...]) -> Optional[dist.ProcessGroup]:
        n = self.size(*axes)
        if self.virtual or n == 1:
            return None
        if n == self.world_size:
            return dist.group.WORLD
        mine, seen = None, set()
        for r in range(self.world_size):  # each group once, in the order of its lowest rank
            members = tuple(self.group_ranks(*axes, rank=r))
            if members in seen:
                continue
            seen.add(members)
            g = dist.new_group(list(members))
            if self.rank in members:
                mine = g
        return mine

    # ---- placements --------------------------------------------------------------------
    def placement(
        self, strategy: Optional[ShardingStrategy] = None, experts: bool = False
    ) -> Placement:
        """Where a unit of `strategy` (the mesh's own by default) keeps its flat parameters;
        `experts`: its flat of this rank's experts (the axes without `expert`)."""
        strategy = self.strategy if strategy is None else strategy
        key = (strategy, experts)
        if key not in self._placements:
            shard, rep = placement_axes(strategy)
            if experts:
                shard = tuple(a for a in shard if a != "expert")
                rep = tuple(a for a in rep if a != "expert")
            distinct = (*shard, "expert") if experts else shard
            self._placements[key] = Placement(
                shard_axes=shard,
                replicate_axes=rep,
                shard_size=self.size(*shard),
                shard_rank=self.coord(*shard),
                shard_group=self.group(*shard),
                replicate_size=self.size(*rep),
                replicate_rank=self.coord(*rep),
                replicate_group=self.group(*rep),
                shard_ranks=tuple(self.group_ranks(*shard)),
                distinct_axes=distinct,
                distinct_group=self.group(*distinct),
                distinct_size=self.size(*distinct),
                expert_group=self.group("expert") if experts else None,
                expert_size=self.size("expert") if experts else 1,
            )
        return self._placements[key]

    @property
    def data_rank(self) -> int:
        """Which share of the samples this rank reads (the ranks of a context group read the
        same samples and split their tokens)."""
        return self.coord(*DATA_AXES)

    @property
    def data_size(self) -> int:
        """How many shares the samples are split into: the world size over the context degree."""
        return self.size(*DATA_AXES)

    # The mesh's own placement, by the names the engine has always used.
    @property
    def shard_size(self) -> int:
        return self.placement().shard_size

    @property
    def shard_rank(self) -> int:
        return self.placement().shard_rank

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        return self.placement().shard_group

    @property
    def replicate_size(self) -> int:
        return self.placement().replicate_size

    @property
    def replicate_rank(self) -> int:
        return self.placement().replicate_rank

    @property
    def replicate_group(self) -> Optional[dist.ProcessGroup]:
        return self.placement().replicate_group

    def describe(self) -> str:
        """One line for the log: "replicate 2 x shard 4 (HYBRID_SHARD, shard groups of 4 ...)";
        an axis of size 1 beyond the first two is left out."""
        shown = [(n, s) for i, (n, s) in enumerate(self.shape.items()) if i < 2 or s > 1]
        axes = " x ".join(f"{name} {size}" for name, size in shown)
        return f"{axes} ({self.why})" if self.why else axes


def placement_axes(strategy: ShardingStrategy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes sharded over, axes replicated over) of a dense unit of `strategy`."""
    if strategy is ShardingStrategy.NO_SHARD:
        return (), PARAM_AXES
    if strategy is ShardingStrategy.HYBRID_SHARD:
        return ("shard", "expert", "context"), ("replicate",)
    return PARAM_AXES, ()


def build_mesh(
    cfg: ShardingConfig,
    rank: int,
    world_size: int,
    local_world_size: int = 1,
    experts: int = 0,
    context: int = 1,
) -> Mesh:
    """The mesh of `cfg` at this world size, with the groups of its own placement created.
    Collective: every rank must call it with the same arguments. local_world_size is
    HYBRID_SHARD's default shard group (ranks per node); `experts`, a mixture's experts;
    `context`, train.context_parallel."""
    shape, why = mesh_plan(cfg, world_size, local_world_size, experts, context)
    mesh = Mesh(rank, world_size, shape, cfg.strategy, why=why)
    mesh.placement()
    return mesh


def virtual_mesh(
    cfg: ShardingConfig,
    rank: int,
    world_size: int,
    local_world_size: int = 1,
    experts: int = 0,
    context: int = 1,
) -> Mesh:
    """The mesh `build_mesh` would give `rank`, without process groups: for planning on the meta
    device, where nothing communicates."""
    shape, why = mesh_plan(cfg, world_size, local_world_size, experts, context)
    return Mesh(rank, world_size, shape, cfg.strategy, virtual=True, why=why)
