"""Run a function on N gloo ranks and collect each rank's result (benchmarks/ranks.py spawns them).

Spawning a rank costs seconds (importing torch); a step of the test model costs milliseconds. So
the ranks of each world size live in a pool for the whole test session: `run_distributed(fn, n,
*args)` sends fn to the n ranks of that pool, which already share a gloo process group, and
returns their results ordered by rank. A failure or a hang discards the pool (the next call
spawns a fresh one), so one broken test cannot leak state into the next.
"""

from __future__ import annotations

import atexit

from benchmarks.ranks import RankPool, free_port  # noqa: F401 -- tests import free_port from here

_POOLS: dict[int, RankPool] = {}


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    """fn(rank, world_size, *args) on each rank of the pool; returns the results ordered by rank.

    fn must be importable (module level) and leave the default process group usable. A failure
    discards the pool: a rank that raised may have left collectives half done."""
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close()
        raise


def fresh_ranks(world_size: int) -> None:
    """Discard the pool of this size: the next call spawns new processes (for tests of start-up)."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


@atexit.register
def _close_pools() -> None:
    for size in list(_POOLS):
        fresh_ranks(size)
