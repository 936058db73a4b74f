"""N gloo ranks in spawned processes: the one way the benchmarks and the tests run ranks.

    results = run_ranks(fn, 3, *args)            # fresh processes, closed after (benchmarks)
    pool = RankPool(3); pool.run(fn, args, 300)  # kept for many calls (tests/dist_utils.py)

fn(rank, world_size, *args) runs on every rank (module level, so spawn can import it); results
come back ordered by rank, tensors as numpy arrays across the queue and torch tensors again on
this side; a rank that raised re-raises here with its traceback, and a rank that does not answer
within the timeout raises TimeoutError.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_numpy(obj):
    """Tensors cross the queue as numpy arrays: torch's queue sharing needs the child alive."""
    if torch.is_tensor(obj):
        t = obj.detach()
        return ("__tensor__", (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy())
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _to_torch(obj):
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def _rank_main(rank, world_size, port, threads, inbox, outbox):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
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
    """world_size spawned processes joined in one gloo process group, each with `threads` torch
    intra-op threads, waiting for functions to run."""

    def __init__(self, world_size: int, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, port, threads, self.inboxes[r], self.outbox),
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


def run_ranks(fn, world_size: int, *args, threads: int = 1, timeout: float = 300.0) -> list:
    """fn on world_size fresh ranks (each with `threads` torch threads); closed afterwards."""
    pool = RankPool(world_size, threads)
    try:
        return pool.run(fn, args, timeout)
    finally:
        pool.close()
