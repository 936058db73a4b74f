"""Ray Train's preemption watcher, started without the error line Ray's own start prints.

Ray Train (2.60) starts a PreemptionWatcher actor per worker group: it polls Ray for nodes being
drained and hands the notice to every worker (what `DrainWatcher` reads). Ray creates it with
max_restarts=-1 and the workers' actor handles as constructor arguments; handles are passed
through the object store, so Ray core logs, at ERROR level, on every group start:

    core_worker.cc: Actor with class name: 'PreemptionWatcher' ... has constructor arguments in
    the object store and max_restarts > 0. If the arguments in the object store go out of
    scope or are lost, the actor restart will fail.

What Ray's restarts are for is a watcher placed on a node that goes away (a num_cpus=0 actor
lands on any node, the one being preempted included: there it dies with the node before or
while it tells the workers). `PreemptionNotices` starts the same watcher, with max_restarts=0,
on the node of Ray Train's controller, which runs it: if that node goes, the job's controller
goes with it and no watcher could help. Every group start (after a failure, a drain or a
resize) creates a fresh watcher, as Ray's does. `replace_rays_watcher` turns Ray's off
(RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0, which Ray passes on to its controller) in its favour.
Where Ray's internals differ, Ray's own watcher is left as it is.
"""

from __future__ import annotations

import os
from typing import Optional

try:  # Ray's internals, probed
    import ray
    from ray._common.utils import env_bool
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError:
    PreemptionCallback = None

if PreemptionCallback is not None:

    class PreemptionNotices(PreemptionCallback):
        """Ray's PreemptionCallback, its watcher created with max_restarts=0 on this node (the
        controller's: the callback runs there)."""

        def after_worker_group_start(self, worker_group) -> None:
            self._stop_watcher()  # a previous group's (Ray's own does the same)
            node_to_ranks: dict[str, list[int]] = {}
            actors_by_rank = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                actors_by_rank[rank] = w.actor
            here = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            )
            watcher = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=here)(
                PreemptionWatcher
            )
            self._watcher = watcher.remote(
                node_to_ranks=node_to_ranks,
                poll_interval_s=self._poll_interval_s,
                worker_actors_by_rank=actors_by_rank,
            )


REPLACED_ENV = "ELASTIC_FSDP_REPLACED_PREEMPTION_WATCHER"
"""Set with Ray's switch when we turn Ray's watcher off for ours. Processes started from this one
inherit both (a test process that built a trainer, then launches the CLI): the marker tells them
the switch is ours, not the user's, so they start our watcher too. Without it such a child read
RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 as the user's choice and ran with no watcher at all: its
workers never heard of a preemption (what failed test_elastic in CI, and only there)."""


def replace_rays_watcher() -> Optional[object]:
    """Call in the driver before the TorchTrainer is built: the callback to add to RunConfig
    (None where the user turned the watcher off, RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0, or
    Ray's internals differ)."""
    if PreemptionCallback is None:
        return None
    ours = os.environ.get(REPLACED_ENV) == "1"
    if not (ours or env_bool(ENABLE_PREEMPTION_WATCHER_ENV_VAR, True)):
        return None
    os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = "0"  # Ray's: off in its controller
    os.environ[REPLACED_ENV] = "1"
    return PreemptionNotices()
