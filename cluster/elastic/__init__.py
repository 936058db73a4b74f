"""Elasticity inside each Ray Train worker: fault drills, graceful drain, and the elastic/* metrics.

Ray Train restarts the worker group when a worker dies or a node leaves, and (elastic
min..max runs) when nodes join; each new group resumes from the newest checkpoint at its own world
size (trainer/loop.py). This package adds what the loop cannot know by itself, through the
WorkerContext hooks that cluster/worker.py wires up:

- `FaultInjector` (faults.py, ctx.before_step): before step s, rank r crashes (os._exit) or is
  drained (SIGTERM). It fires once per run: a marker is written to the run folder before it
  fires, so the restarted group, or the same run submitted again, trains through step s.
- `DrainWatcher` (drain.py, ctx.should_stop): a SIGTERM to the worker (Kubernetes, a spot
  reclaim, the drill above) or Ray's preemption notice (what ray.train.get_preemption_info
  returns) makes the loop commit a checkpoint of the current step and leave, so a graceful leave
  loses no step. The handler is installed in each worker's main thread by `SigtermCallback`
  (Python only lets that thread); `leave` then ends the process of a rank that was asked to go.
- `ClusterView` (cluster_view.py, a Ray Train controller callback, elastic runs only): Ray sizes
  an elastic group from a view of the nodes it renews every 20 s and that counts nodes being
  drained: a restart after a node loss or a preemption would ask for the leaving node and wait
  out the group start timeout (60 s), a node that joined would wait up to 20 s. The callback
  renews the view when it matters and keeps leaving nodes out of the decision. When Ray grows a
  running group (a node joined), it first asks the group to drain (`GrowDrain`, grow.py; rank 0
  reads the request through `DrainRequests` in its DrainWatcher) and waits for the ack, so a
  join loses no step.
- `ElasticTracker` (tracker.py, ctx.before_step and ctx.after_step, rank 0): one small JSON
  record per worker-group start, from which come elastic/restarts, elastic/recovery_s (the
  failure to the first step after the resume) and elastic/steps_lost, and a line saying where the
  recovery time went. `chain` makes one before_step hook of the tracker's and the drill's.
- `RestartClock` (clock.py, a controller callback, every run): when Ray decided to end a group,
  tore it down and began the next, so the tracker can split the "ray restart" phase.
- `replace_rays_watcher` (preemption.py, the driver): Ray Train's preemption watcher, started
  without the ERROR line Ray's own start logs at every worker-group start.

The run folder (run_folder.py) is Ray Train's (<storage_path>/<run_name>, a local path or any
pyarrow filesystem):

    elastic/fault.json                the fired fault: kind, rank, step, time
    elastic/drain_request.json        the controller's drain request before a grow (grow.py)
    elastic/drain_ack.json            rank 0's answer once the drain's checkpoint committed
    elastic/controller_clock.json     the controller's times of the last group start (clock.py)
    elastic/attempts/<start ns>.json  one worker-group start: launch, world size, start step,
                                      progress (last step trained and when), recovery figures
"""

from __future__ import annotations

import importlib

from cluster.elastic.clock import RestartClock
from cluster.elastic.drain import (
    WORKER_TIMES,
    DrainedError,
    DrainWatcher,
    SigtermCallback,
    install_sigterm_handler,
    leave,
    preemption_notice,
    training,
)
from cluster.elastic.faults import DRAIN_ACK_TIMEOUT_S, FAULT_MARKER, FaultInjector
from cluster.elastic.grow import DrainRequests, GrowDrain
from cluster.elastic.preemption import replace_rays_watcher
from cluster.elastic.run_folder import ELASTIC_DIR, RunFolder
from cluster.elastic.tracker import ATTEMPTS_DIR, ElasticTracker, chain

# The controller's callbacks load Ray Train's scaling policy, and with it Ray Data (a quarter of a
# second, more on a busy node): imported when first used, so a worker restart does not pay it.
_CONTROLLER_SIDE = {
    "COORDINATOR": "cluster.elastic.cluster_view",
    "ClusterView": "cluster.elastic.cluster_view",
    "count_usable_nodes_only": "cluster.elastic.cluster_view",
    "workers_that_fit": "cluster.elastic.cluster_view",
    "cluster_view": "cluster.elastic.cluster_view",
}


def __getattr__(name: str):
    if name in _CONTROLLER_SIDE:
        module = importlib.import_module(_CONTROLLER_SIDE[name])
        return module if name == "cluster_view" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTEMPTS_DIR",
    "COORDINATOR",
    "DRAIN_ACK_TIMEOUT_S",
    "ELASTIC_DIR",
    "FAULT_MARKER",
    "WORKER_TIMES",
    "ClusterView",
    "RestartClock",
    "DrainWatcher",
    "DrainedError",
    "ElasticTracker",
    "FaultInjector",
    "RunFolder",
    "SigtermCallback",
    "chain",
    "count_usable_nodes_only",
    "DrainRequests",
    "GrowDrain",
    "install_sigterm_handler",
    "leave",
    "preemption_notice",
    "replace_rays_watcher",
    "training",
    "workers_that_fit",
]
