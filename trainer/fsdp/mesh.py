"""Process groups for a sharding strategy: a shard group (parameters split 1/S inside it) and a
replicate group (shards all-reduced across it). S * R == world size.

FULL_SHARD / SHARD_GRAD_OP: S = world, R = 1.  NO_SHARD: S = 1, R = world.
HYBRID_SHARD: S = ranks per node (consecutive ranks), R = number of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .config import ConfigError, ShardingConfig, ShardingStrategy


@dataclass
class ShardMesh:
    rank: int
    world_size: int
    shard_size: int
    shard_rank: int
    shard_group: Optional[dist.ProcessGroup]
    replicate_size: int
    replicate_rank: int
    replicate_group: Optional[dist.ProcessGroup]


def hybrid_group_size(world_size: int, requested: int, local_world_size: int) -> int:
    size = requested or local_world_size or 1
    if world_size % size:
        raise ConfigError(
            f"invalid config: sharding.hybrid_shard_group_size={size} (from "
            f"{'config' if requested else 'LOCAL_WORLD_SIZE'}) does not divide world size "
            f"{world_size}; valid: a divisor of {world_size}"
        )
    return size


def mesh_shape(
    strategy: ShardingStrategy, world_size: int, hybrid_size: int = 0, local_world_size: int = 1
) -> tuple[int, int]:
    """(shard group size, replicate group size) of a strategy at a world size."""
    if strategy is ShardingStrategy.NO_SHARD:
        shard = 1
    elif strategy is ShardingStrategy.HYBRID_SHARD:
        shard = hybrid_group_size(world_size, hybrid_size, local_world_size)
    else:
        shard = world_size
    return shard, world_size // shard


def build_mesh(
    cfg: ShardingConfig, rank: int, world_size: int, local_world_size: int = 1
) -> ShardMesh:
    """Create the groups of `cfg.strategy` at this world size. Collective: every rank must call it
    with the same arguments. local_world_size is HYBRID_SHARD's default group (ranks per node)."""
    shard, rep = mesh_shape(cfg.strategy, world_size, cfg.hybrid_shard_group_size, local_world_size)
    default = dist.group.WORLD if world_size > 1 else None
    shard_group = rep_group = None
    if 1 < shard < world_size or 1 < rep < world_size:
        # new_group is collective over all ranks: create every group in the same order everywhere.
        for start in range(0, world_size, shard):
            g = dist.new_group(list(range(start, start + shard)))
            if start <= rank < start + shard:
                shard_group = g
        for offset in range(shard):
            g = dist.new_group(list(range(offset, world_size, shard)))
            if rank % shard == offset:
                rep_group = g
    if shard == world_size:
        shard_group = default
    if rep == world_size:
        rep_group = default
    return ShardMesh(
        rank,
        world_size,
        shard,
        rank % shard,
        shard_group if shard > 1 else None,
        rep,
        rank // shard,
        rep_group if rep > 1 else None,
    )


def virtual_mesh(
    cfg: ShardingConfig, rank: int, world_size: int, local_world_size: int = 1
) -> ShardMesh:
    """The mesh `build_mesh` would give `rank`, without process groups: for planning on the meta
    device, where nothing communicates."""
    shard, rep = mesh_shape(cfg.strategy, world_size, cfg.hybrid_shard_group_size, local_world_size)
    return ShardMesh(rank, world_size, shard, rank % shard, None, rep, rank // shard, None)
