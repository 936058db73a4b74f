"""Elasticity inside each Ray Train worker: fault drills, graceful drain, and the elastic/* metrics.

Ray Train restarts the worker group when a worker dies or a node leaves, and (elastic
min..max runs) when nodes join; each new group resumes from the newest checkpoint at its own world
size (trainer/loop.py). This package adds what the loop cannot know by itself, through the
WorkerContext hooks built in hooks.py (`WorkerHooks`, which cluster/worker.py hands the loop)
and the Ray Train callbacks built in callbacks.py (`ray_callbacks`, cluster/launch.py's):

- `FaultInjector` (faults.py, ctx.before_step): before step s, rank r crashes (os._exit) or is
  drained (SIGTERM). It fires once per run: a marker is written to the run folder before it
  fires, so the restarted group, or the same run submitted again, trains through step s.
- `DrainWatcher` (drain.py, ctx.should_stop): a SIGTERM to the worker (Kubernetes, a spot
  reclaim, the drill above) or Ray's preemption notice (what ray.train.get_preemption_info
  returns) makes the loop commit a checkpoint of the current step and leave, so a graceful leave
  loses no step. The handler is installed in each worker's main thread by `SigtermCallback`
  (Python only lets that thread).
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
- `leave_gracefully` (leave.py): how the group leaves once the loop stopped early (the record,
  the answer to the controller, who must go, the keeper of a leaving node, then together).
- `SpareRequest` and `preload` (spares.py): spare worker processes, started and warmed ahead
  on each node, so that a restarted group does not wait for Python's imports.

Their documents live in the run folder's elastic/ folder (cluster/run/folder.py lists them).
This package's __init__ imports nothing: most of its modules import Ray Train, and the driver
and the spares' preload import only the modules they use.
"""
