"""The worker's elastic hooks: what cluster/worker.py hands the loop through its WorkerContext,
and how the worker group ends or leaves.

    hooks = WorkerHooks(cfg, folder, rank, world_size, launch_id, entered, startup)
    WorkerContext(..., should_stop=hooks.drain, before_step=hooks.before_step, ...)
    with training():                       # drain.py: a SIGTERM now means "checkpoint, then go"
        result = run_training(cfg, ctx)
    hooks.finished(result.steps_done)      # all steps done: a late drain request answered
    hooks.leave(result.steps_done, steps, result.last_checkpoint, stop_keeper)   # else: leave.py

Every hook of the package (its __init__ lists them) that runs inside a worker is built here, in
the order the worker needs them: the tracker's record of this group start first (tracker.py),
the drain watcher (drain.py, with rank 0's reader of the controller's requests: grow.py), then
the before-step chain (the tracker, the fault drill: faults.py, the spare request: spares.py).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from cluster.config import JobConfig
from cluster.elastic.drain import WORKER_TIMES, DrainWatcher, preemption_notice
from cluster.elastic.faults import FaultInjector
from cluster.elastic.grow import DrainRequests
from cluster.elastic.leave import leave_gracefully
from cluster.elastic.spares import SpareRequest, record_worker_env, this_process
from cluster.elastic.tracker import ElasticTracker, chain
from cluster.run.folder import RunFolder


class WorkerHooks:
    """One worker's elastic parts for one group start: the tracker (elastic/* metrics), the
    drain watcher (WorkerContext.should_stop), the before-step chain, and the group's end."""

    def __init__(
        self,
        cfg: JobConfig,
        folder: RunFolder,
        rank: int,
        world_size: int,
        launch_id: str,
        entered: float,
        startup: Optional[dict] = None,
    ):
        """`folder`: the run's elastic/ folder. `entered`: when the training function started
        (the imports since are timed: ElasticTracker's imports_s). `startup`: the driver's
        phases (LaunchInfo.startup)."""
        self.rank, self.world_size = rank, world_size
        context = WORKER_TIMES.get("context")  # when Ray had created this worker (drain.py)
        times = {"context": context, "entered": entered, "imported": time.time()}
        self.tracker = ElasticTracker(
            folder, rank, world_size, launch_id, times, startup=startup, process=this_process()
        )
        self.drain = DrainWatcher(
            rank,
            preemption_info=preemption_notice(),
            requests=DrainRequests(folder, launch_id) if rank == 0 else None,
        )
        spares_on = cfg.cluster.spares_on
        if rank == 0 and spares_on:  # the controller starts spares on joined nodes
            record_worker_env(folder, launch_id)
        self.before_step: Callable[[int], None] = chain(
            self.tracker.before_step,
            FaultInjector(cfg.fault, rank, folder),
            SpareRequest() if spares_on else None,  # a spare process on this node, after step 1
        )
        self.on_step = self.tracker.on_step
        """WorkerContext.after_step's elastic part: the elastic/* metrics."""

    def finished(self, steps_done: int) -> None:
        """The run trained all its steps: rank 0 answers a drain request the controller made
        since its last poll (grow.py), or the controller would wait it out."""
        if self.drain.requests is not None:
            self.drain.requests.finished(steps_done)

    def leave(
        self,
        steps_done: int,
        steps: int,
        checkpoint: Optional[str],
        stop_keeper: Optional[Callable[[], None]] = None,
    ) -> None:
        """The loop returned early (the drain watcher said so) having committed `checkpoint`:
        the group leaves together (leave.py). `stop_keeper`: stops this node's snapshot keeper
        if its node leaves (None without snapshots). Never returns."""
        leave_gracefully(
            self.drain,
            self.tracker,
            self.rank,
            self.world_size,
            steps_done,
            steps,
            checkpoint,
            stop_keeper=stop_keeper,
        )
