"""When the Ray Train controller acted on a failure, for the recovery breakdown of the next group.

A worker sees when its train context was made; what happened before (Ray noticing the failure,
tearing the old group down, deciding the new size, placing and starting the new workers) happens
in the controller. (Its process's start time says nothing: Ray starts worker processes ahead,
before the failure even.) `RestartClock` (a controller callback, every run) notes those times
and writes them to the run folder as the controller begins each group start; the new group's
rank 0 (tracker.py) reads them once, at its first step, and splits the "ray restart" phase with
them.
"""

from __future__ import annotations

import time
from typing import Optional

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from cluster.elastic.cluster_view import release_dead_launch_request
from cluster.run.folder import RunFolder

CLOCK = "controller_clock.json"
"""elastic/controller_clock.json: the controller's times of the last group start."""


class RestartClock(ControllerCallback, WorkerGroupCallback):
    """Notes, in the controller, when Ray decided to end the running group (`decided`: its
    failure decision, or a resize of the running group), when it finished tearing the group
    down (`teardown_done`; the teardown phase runs from the decision) and when it began
    starting the next group (`group_start`, written then). A write that fails is printed once
    and ignored: it only feeds a breakdown."""

    def __init__(self, folder: RunFolder, launch_id: str):
        self.folder, self.launch_id = folder, launch_id
        self._times: dict[str, Optional[float]] = {}
        self._off = False

    def after_controller_start(self, train_run_context) -> None:
        release_dead_launch_request(self.folder, self.launch_id, train_run_context.run_id)

    def before_controller_execute_failure_decision(self, failure_decision, *args, **kwargs):
        self._times.setdefault("decided", time.time())

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        self._times.setdefault("decided", time.time())  # after a failure's: not the first

    def after_worker_group_shutdown(self, worker_group_context) -> None:
        self._times["teardown_done"] = time.time()

    def before_worker_group_start(self, worker_group_context) -> None:
        times = {**self._times, "group_start": time.time(), "launch": self.launch_id}
        self._times = {}
        if self._off:
            return
        try:
            self.folder.write(CLOCK, times)
        except Exception as e:  # never fail the run over a breakdown
            self._off = True
            print(f"elastic: cannot write {CLOCK} ({type(e).__name__}: {e})", flush=True)


CLOCK_SKEW_S = 0.5
"""How far before the failure (as a worker timed it) the controller's group start may read and
still be this restart's: the two clocks are different processes', perhaps machines'."""


def ray_phases(
    clock: Optional[dict], launch_id: str, failure: float, context: float
) -> Optional[dict[str, float]]:
    """The "ray restart" phase (`failure` to the new workers' train `context`) split at the
    controller's times:

        detect         the failure to Ray's decision to end the group (its health check; for a
                       grow, the drain the controller waited for)
        teardown       the old group's shutdown
        decide         its end to the next group's start (scheduling, sizing)
        start_workers  the placement group, the worker actors (a worker process Ray had
                       started ahead, or a new one) and Ray Train's setup in them

    None where the clock is not this restart's or a time is missing."""
    if not clock or clock.get("launch") != launch_id:
        return None
    marks = [
        ("detect_s", clock.get("decided")),
        ("teardown_s", clock.get("teardown_done")),
        ("decide_s", clock.get("group_start")),
        ("start_workers_s", context),
    ]
    if any(t is None for _, t in marks) or marks[2][1] < failure - CLOCK_SKEW_S:
        return None
    phases, at = {}, failure
    for name, t in marks:
        phases[name], at = max(t - at, 0.0), max(t, at)
    return phases
