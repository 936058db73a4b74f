"""The driver's elastic callbacks: what Ray Train's controller and worker group run besides the
training function, for one run (cluster/launch.py build_trainer puts them in its RunConfig).

    callbacks = ray_callbacks(cfg.cluster, RunFolder.of_run(cfg.cluster), launch_id)

Every run: `SigtermCallback` (drain.py: each worker's SIGTERM handler, the graceful drain) and
`RestartClock` (clock.py: when Ray ended a group and began the next), and our preemption watcher
in place of Ray's (preemption.py). An elastic run (cluster.min_workers..max_workers) also gets
`ClusterView` (cluster_view.py): the view of usable nodes Ray sizes a group by, the drain before
a grow (grow.py), and, where spares are on, the spares warmed on joined nodes (spares.py).
Imports Ray Train: the driver imports this module only to build a trainer.
"""

from __future__ import annotations

from cluster.config import ClusterConfig
from cluster.elastic import spares
from cluster.elastic.clock import RestartClock
from cluster.elastic.cluster_view import ClusterView
from cluster.elastic.drain import SigtermCallback
from cluster.elastic.grow import GrowDrain
from cluster.elastic.preemption import replace_rays_watcher
from cluster.run.folder import RunFolder


def ray_callbacks(cluster: ClusterConfig, folder: RunFolder, launch_id: str) -> list:
    """RunConfig.callbacks of one run, as the module docstring lists them. Call it before the
    TorchTrainer is built: replacing Ray's preemption watcher sets what Ray's controller reads."""
    preemption = replace_rays_watcher()  # Ray's own logs an ERROR line at every group start
    callbacks = [SigtermCallback(), RestartClock(folder, launch_id)]
    if preemption is not None:
        callbacks.append(preemption)
    if cluster.elastic:
        callbacks.append(cluster_view(cluster, folder, launch_id))
    return callbacks


def cluster_view(cluster: ClusterConfig, folder: RunFolder, launch_id: str) -> ClusterView:
    """An elastic run's view of the cluster. The running group checkpoints before Ray grows it
    (GrowDrain: the controller reaches the group through the run folder)."""
    lo, hi = cluster.world_sizes
    return ClusterView(
        cluster.elastic_resize_monitor_interval_s,
        lo,
        GrowDrain(folder, cluster.drain_on_grow_timeout_s, launch_id=launch_id),
        max_workers=hi,
        settle_s=cluster.grow_settle_s,
        warm_joined=spares.joined_node_warmer(folder, launch_id, cluster)
        if cluster.spares_on
        else None,
    )
