"""Run a function on N gloo ranks and collect each rank's result.

Spawning a rank costs seconds (importing torch); a step of the test model costs milliseconds. So
the ranks of each world size live in a pool for the whole test session: `run_distributed(fn, n,
*args)` sends fn to the n ranks of that pool, which already share a gloo process group, and
returns their results ordered by rank. A failure or a hang discards the pool (the next call
spawns a fresh one), so one broken test cannot leak state into the next.
"""

from __future__ import annotations

import atexit
import os
import queue as queue_mod
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_numpy(obj):
    """Tensors cross the queue as numpy arrays: torch's queue sharing needs the child alive."""
    import torch

    if torch.is_tensor(obj):
        t = obj.detach()
        return ("__tensor__", (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy())
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _to_torch(obj):
    import torch

    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def _rank_main(rank, world_size, port, inbox, outbox):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            outbox.put((rank, "ok", _to_numpy(fn(rank, world_size, *args))))
        except BaseException:  # the parent re-raises with the child's traceback
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, port, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout: float):
        for inbox in self.inboxes:
            inbox.put((fn, args))
        results, errors = {}, []
        for _ in range(self.world_size):
            try:
                # once a rank failed, the others are likely stuck in a collective: do not wait long
                rank, status, value = self.outbox.get(timeout=10.0 if errors else timeout)
            except queue_mod.Empty:
                if errors:
                    break
                raise TimeoutError(
                    f"{fn.__name__} on {self.world_size} ranks: no answer in {timeout} s"
                )
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
            results[rank] = value
        if errors:
            raise RuntimeError("\n".join(errors))
        return [_to_torch(results[r]) for r in range(self.world_size)]

    def close(self) -> None:
        for inbox, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


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
