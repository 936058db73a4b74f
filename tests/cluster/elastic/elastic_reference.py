"""The losses an elastic run must reproduce: the same config trained without Ray or failures.

A change of world size reorders the float sums of a step (the ranks' shares are summed in
another grouping), which moves a loss by ~1e-7 relative; over hundreds of steps such differences
grow past 1e-5 (measured on the elastic tests' config: world 1 vs world 2 differ by 3e-5 at step
13 and 6e-4 at step 58). So the reference trains at the same world sizes as the run it checks,
switching at the steps where the run resumed at a new size, through a checkpoint, under
torch.multiprocessing + gloo (tests/dist_utils.py): `schedule` is [(world size, stop before
step), ...], the last stop None.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tests.dist_utils import run_distributed
from trainer.loop import WorkerContext, run_training


def train_segment(rank: int, world: int, cfg, root: str, stop_at: Optional[int]) -> list:
    """One rank: resume from `root` (if it holds a checkpoint), train until step `stop_at`."""
    next_step = [0]

    def before_step(step: int) -> None:
        next_step[0] = step + 1  # should_stop is asked before each step

    stop = (lambda: next_step[0] >= stop_at) if stop_at is not None else None
    result = run_training(
        cfg,
        WorkerContext(
            rank=rank,
            world_size=world,
            checkpoint_root=root,
            should_stop=stop,
            before_step=before_step,
            device="cpu",
        ),
    )
    return result.losses


def reference_losses(
    cfg, schedule: Sequence[tuple[int, Optional[int]]], root: str, complete: bool = True
) -> dict[int, float]:
    """{step: loss} of `cfg` trained segment by segment at the schedule's world sizes (to the
    end when `complete`; else a branch: up to the last segment's stop, as a group whose last
    steps were lost trained them)."""
    losses: dict[int, float] = {}
    for world, stop_at in schedule:
        per_rank = run_distributed(train_segment, world, cfg, root, stop_at)
        losses.update((int(s), float(v)) for s, v in per_rank[0])
    if complete:
        assert sorted(losses) == list(range(cfg.train.steps)), "the reference trained every step"
    return losses
