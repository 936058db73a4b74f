"""How a worker group leaves after a graceful stop: one protocol, the same on every rank.

    result = run_training(cfg, ctx)                        # returned early: should_stop said so
    leave_gracefully(drain, tracker, rank, world_size, result.steps_done, cfg.train.steps,
                     result.last_checkpoint, stop_keeper)  # never returns

The loop stopped on one rank's word (a SIGTERM, Ray's preemption notice, the controller's drain
request before a grow: drain.py) and committed a checkpoint of the step it was at. Then, in this
order, every rank:

1. notes where the group left (rank 0's record, tracker.py);
2. answers the controller's drain request, if there was one (grow.py): it may go on;
3. learns whether its own process must go (`agree_who_leaves`);
4. stops its node's snapshot keeper if its node is leaving (snapshots/keepers.py);
5. waits for every other rank's bookkeeping (`leave_together`);
6. ends its process if it must go, else raises DrainedError so that Ray restarts the group
   (`leave`).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from cluster.elastic.drain import DrainedError, DrainWatcher
from cluster.elastic.tracker import ElasticTracker


def leave_gracefully(
    drain: DrainWatcher,
    tracker: ElasticTracker,
    rank: int,
    world_size: int,
    step: int,
    steps: int,
    checkpoint: Optional[str],
    stop_keeper: Optional[Callable[[], None]] = None,
    exit_process: Callable[[int], None] = os._exit,
) -> None:
    """The protocol of the module docstring, after the loop returned at `step` (of `steps`)
    having committed `checkpoint`. `stop_keeper` stops this node's snapshot keeper (None when
    snapshots are off). Ends the process or raises DrainedError; returns only in a test whose
    `exit_process` returns."""
    tracker.left(step)
    if drain.requests is not None:  # its checkpoint is committed: the controller may go on
        drain.requests.acknowledge(step)
    agree_who_leaves(drain, rank, world_size)
    if drain.leaving and stop_keeper is not None:  # this node goes: so does its keeper
        stop_keeper()
    leave_together(rank, world_size)
    leave(
        drain,
        f"rank {rank} left at step {step} of {steps} "
        f"({drain.reason or 'another rank was asked to stop'}) after committing {checkpoint}; "
        "Ray Train restarts the worker group from it",
        exit_process,
    )


def agree_who_leaves(drain: DrainWatcher, rank: int, world_size: int) -> None:
    """Every rank learns whether its own process must go. The group stopped on one rank's word
    (the loop agrees with a MAX all-reduce), but Ray hands its preemption notice to each worker
    in turn: a preempted rank can stop on another's notice before its own arrived, and would
    then neither stop its node's keeper (the node lingers, and keeps copies of snapshots
    meant to be elsewhere) nor end its process. Each rank contributes the ranks it knows must
    go (the notice's, or itself after a SIGTERM); a MAX all-reduce unites them."""
    if world_size <= 1 or not dist.is_initialized():
        return
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    going = torch.zeros(world_size, device=device)
    for r in drain.leaving_ranks():
        going[r] = 1.0
    try:
        dist.all_reduce(going, op=dist.ReduceOp.MAX)
    except Exception as e:  # another rank is gone already: keep what this one knows
        print(f"rank {rank}: cannot learn who leaves ({type(e).__name__}: {e})", flush=True)
        return
    if going[rank].item() > 0 and not drain.leaving:
        drain.leaving = True
        print(f"rank {rank}: another rank saw this one's preemption notice: leaving", flush=True)


def leave_together(rank: int, world_size: int) -> None:
    """Wait until every rank has done its bookkeeping (rank 0's record of where the group left
    and its answer to the controller's drain request, a leaving node's keeper stopped) before
    any rank ends: the first DrainedError Ray sees may be the run's last allowed failure, and
    Ray then kills the whole group at once."""
    if world_size <= 1:
        return
    try:
        if dist.is_initialized():
            dist.barrier()
    except Exception as e:  # another rank is gone already: nothing to wait for
        print(f"rank {rank}: leaving without the others ({type(e).__name__}: {e})", flush=True)


def leave(
    drain: DrainWatcher, message: str, exit_process: Callable[[int], None] = os._exit
) -> None:
    """After a graceful stop (the checkpoint is committed): end the run of this worker group.

    A rank that was itself asked to go ends its process: its node (drained or preempted) then
    goes idle, and its raylet exits, so the next group is sized without it. The other ranks
    raise DrainedError: returning would tell Ray that training is finished."""
    if drain.leaving:
        print(f"{message}; this process exits", flush=True)
        exit_process(0)
        return  # only a test's exit_process returns
    raise DrainedError(message)
