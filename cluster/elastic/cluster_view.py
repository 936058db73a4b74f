"""The Ray Train controller's view of the cluster, kept in step with the nodes really there.

Ray sizes an elastic group from a view of the nodes it renews every 20 s and that counts nodes
being drained: a restart after a node loss or a preemption would ask for the leaving node and
wait out the group start timeout (60 s), a node that joined would wait up to 20 s. `ClusterView`
(a controller callback, elastic runs only) renews the view when it matters and keeps leaving
nodes out of the decision.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback

from cluster.config import JobConfig, job_from_dict
from cluster.elastic.grow import GrowDrain

try:  # Ray's internals, probed: where they moved, the policy's 1 s cache (Ray 2.60) is assumed
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
except ImportError:
    ElasticScalingPolicy = None

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")
"""(name, namespace) of Ray's detached actor that elastic Ray Train asks for node resources."""


class ClusterView(ControllerCallback):
    """Keep Ray Train's elastic sizing in step with the nodes that are really there.

    Runs in the Ray Train controller (elastic runs only). Two blind spots of Ray 2.60's elastic
    policy, each of which costs a failed group start (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S,
    60 s) or a late resize:

    - It sizes groups from its AutoscalingCoordinator's node view, which that actor renews on its
      own 20 s tick only (no setting): a restart right after a node loss asks for the lost node;
      a node that joined is seen up to 20 s late. `get_reserved_resources(recompute=True)` renews
      the view at once (one ray.nodes() call): done when the controller starts, when it restarts
      or reschedules the group, and, while running, once per elastic_resize_monitor_interval_s.
      The policy also caches the coordinator's answer for 1 s (GET_RESERVED_RESOURCES_INTERVAL_S):
      a restart within that second of the running group's last resize check sizes itself from
      the view before the failure, where a lost node is left out by the count below (a restart
      used to wait that second out: 1 s of every recovery).
    - The coordinator counts a node being drained (a preemption) as available until its raylet
      exits (on a cloud, at the preemption deadline; here, once nothing runs on it): the restart
      after a preemption would ask for the leaving node's workers too, and while the node
      lingers, every resize check of the running group would decide to grow onto it, each time
      a restart of the group. `count_usable_nodes_only` (installed in the controller when it
      starts) caps the policy's count at what the alive, non-draining nodes hold (never below
      the running group's size: its preempted workers drain first), so it decides nothing
      while the node lingers; `before_controller_execute_resize_decision` lowers a
      decision to what those nodes hold (never below min_workers, never higher than Ray
      decided), the fallback where Ray's policy moved.

    And one rule of the job's: train.context_parallel splits only some world sizes (it is never
    re-planned, JobConfig.splits_context): the count is lowered to the largest size it splits
    (a group Ray would start at 3 with context 2 starts at 2; a running group of 2 that could
    grow to 3 keeps running), and so is every decision, so no group starts that its workers'
    mesh would refuse. The job is read from the run's train_loop_config when the controller
    starts.

    Its hooks never raise (Ray would count a callback error as a failure of the run): an error in
    the renewal switches it off, Ray's own tick still works; the clipping falls back to Ray's
    decision."""

    SETTLE_POLL_S = 0.25

    def __init__(
        self,
        interval_s: float,
        min_workers: int,
        grow: Optional[GrowDrain] = None,
        max_workers: Optional[int] = None,
        settle_s: float = 0.0,
        warm_joined: Optional[Callable[[list[dict], dict[str, int]], Optional[str]]] = None,
    ):
        """`grow`: asks a running group to drain before Ray grows it (None: Ray grows it as is,
        and the steps since the last checkpoint are trained again). `settle_s`: before growing
        a running group, wait this long for more nodes (up to `max_workers`' worth) while the
        group trains on (cluster.grow_settle_s). `warm_joined(nodes, {node id: workers})`:
        before a grow, starts spares on the nodes that joined since the running group started
        and waits for them (spares.warm_joined_nodes; None where spares are off)."""
        self.interval_s, self.min_workers = interval_s, min_workers
        self.max_workers, self.settle_s = max_workers, settle_s
        self.warm_joined = warm_joined
        self._group_nodes: Optional[set[str]] = None  # the usable nodes when the group started
        self.grow = grow
        self._last = float("-inf")
        self._off = False
        self._resizing_running = False  # Ray decided to resize the running group
        self._size: Optional[int] = None  # the size of the group running (the last decision's)
        self._job: Optional[JobConfig] = None  # the run's job, read when the controller starts

    def after_controller_start(self, train_run_context) -> None:
        self._job = run_job(train_run_context)
        if not count_usable_nodes_only(startable=self._startable):
            print(
                "elastic: Ray's elastic policy has no _count_possible_workers to wrap (Ray "
                "moved it): a draining node may cost a restart of the group at its own size",
                flush=True,
            )
        self._refresh()

    def after_controller_state_update(self, previous_state, current_state) -> None:
        kind = type(current_state).__name__
        if kind == "ResizingState" and type(previous_state).__name__ == "RunningState":
            self._resizing_running = True  # Running -> Resizing -> Scheduling -> the decision
        elif kind not in ("ResizingState", "SchedulingState"):
            self._resizing_running = False
        if kind in ("RestartingState", "ReschedulingState"):
            self._refresh()
        elif kind == "RunningState" and time.monotonic() - self._last >= self.interval_s:
            self._refresh()

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        try:
            fits = workers_that_fit(resize_decision.resources_per_worker)
        except Exception:  # Ray's decision stands
            return
        if self.min_workers <= fits < resize_decision.num_workers:
            print(
                f"elastic: Ray chose {resize_decision.num_workers} workers, but the nodes not "
                f"being drained hold {fits}: starting {fits}",
                flush=True,
            )
            resize_decision.num_workers = fits
        self._split_context(resize_decision)
        growing = self._size is not None and resize_decision.num_workers > self._size
        if self._resizing_running and growing:
            resize_decision.num_workers = self._settle(resize_decision)
            self._split_context(resize_decision)
            self._warm_joined_nodes(resize_decision)
            if self.grow is not None:
                self._drain_before_resize(resize_decision.num_workers)
        self._resizing_running = False
        self._size = resize_decision.num_workers
        try:
            self._group_nodes = {n["NodeID"] for n in usable_nodes()}
        except Exception:  # only for the next grow's spares
            self._group_nodes = None

    def _startable(self, n: int) -> int:
        """The largest world size <= n the job's train.context_parallel splits (0: none)."""
        if self._job is None:
            return n
        return next((m for m in range(n, 0, -1) if self._job.splits_context(m)), 0)

    def _split_context(self, decision) -> None:
        """Lower the decision to a size train.context_parallel splits (never below min_workers:
        a range whose ends it does not split is refused at submit, JobConfig.validate)."""
        n = self._startable(decision.num_workers)
        if self.min_workers <= n < decision.num_workers:
            print(
                f"elastic: Ray chose {decision.num_workers} workers, but "
                f"train.context_parallel={self._job.train.context_parallel} does not split "
                f"them: starting {n}",
                flush=True,
            )
            decision.num_workers = n

    def _settle(self, decision, sleep=time.sleep, clock=time.monotonic) -> int:
        """Nodes of a scale-up come a second or more apart: Ray grows the group onto the first,
        and a second restart follows for the next (a join of two nodes took 23-26 s instead of
        ~10). Before a grow, wait up to settle_s (the running group trains on: its reports go
        from a thread of their own, run/reporter.py, so none blocks it while the controller
        waits here) for more nodes, and grow onto all that hold workers then, up to
        max_workers. Returns the size to start."""
        n = decision.num_workers
        if self.settle_s <= 0 or self.max_workers is None or n >= self.max_workers:
            return n
        deadline, fits = clock() + self.settle_s, n
        while True:
            try:
                fits = max(
                    fits, min(self.max_workers, workers_that_fit(decision.resources_per_worker))
                )
            except Exception:  # Ray's decision stands
                return n
            if fits >= self.max_workers or clock() >= deadline:
                break
            sleep(min(self.SETTLE_POLL_S, max(deadline - clock(), 0.0)))
        if fits > n:
            print(
                f"elastic: Ray chose {n} workers; more nodes joined within "
                f"{self.settle_s:.0f} s: starting {fits}",
                flush=True,
            )
        return fits

    def _warm_joined_nodes(self, decision) -> None:
        """Spares on the nodes that joined, warm before the group is torn down to grow: the new
        group's actors there then start in preloaded processes, as the old nodes' do."""
        if self.warm_joined is None or self._group_nodes is None or self._size is None:
            return
        try:
            nodes = usable_nodes()
            extra = decision.num_workers - self._size
            per_node: dict[str, int] = {}
            for n in nodes:
                if n["NodeID"] in self._group_nodes or extra <= 0:
                    continue
                fits = workers_that_fit(decision.resources_per_worker, [n], set())
                if fits > 0:
                    per_node[n["NodeID"]] = min(fits, extra)
                    extra -= per_node[n["NodeID"]]
            line = self.warm_joined(nodes, per_node) if per_node else None
        except Exception as e:  # never fail the run over an optimisation
            line = f"elastic: no spares on the joined nodes ({type(e).__name__}: {e})"
        if line:
            print(line, flush=True)

    def _drain_before_resize(self, num_workers: int) -> None:
        """The running group checkpoints the step it is at before Ray tears it down."""
        try:
            t0 = time.monotonic()
            ack = self.grow.drain(f"Ray is resizing the group to {num_workers} workers")
        except Exception as e:  # never fail the run over an optimisation
            print(f"elastic: could not drain before the resize ({type(e).__name__}: {e})")
            return
        if ack is None:
            print(
                f"elastic: the group did not drain within {self.grow.timeout_s:.0f} s; resizing "
                f"to {num_workers} workers anyway (the steps since its last checkpoint are "
                "trained again)",
                flush=True,
            )
        else:
            print(
                f"elastic: drained at step {ack['step']} in {time.monotonic() - t0:.1f} s "
                f"before resizing to {num_workers} workers",
                flush=True,
            )

    def _refresh(self) -> None:
        if self._off:
            return
        self._last = time.monotonic()
        try:
            actor = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
            ray.get(
                actor.get_reserved_resources.remote("elastic-fsdp-view", recompute=True), timeout=5
            )
        except Exception as e:  # never fail the run over an optimisation
            self._off = True
            print(
                f"elastic: cannot renew Ray's cluster view ({type(e).__name__}: {e}); "
                "node changes are seen on Ray's 20 s tick",
                flush=True,
            )


REQUEST_RECORD = "coordinator_request.json"
"""elastic/coordinator_request.json: the requester id under which this run's current launch asks
Ray's AutoscalingCoordinator for its workers' resources (Ray Train: train-<run id>)."""


def release_dead_launch_request(folder, launch_id: str, run_id: str, log=print) -> Optional[str]:
    """In the controller, as a launch starts: cancel the coordinator request of the run's previous
    launch, then record this one's. A launch that ends cancels its own request; a driver that was
    killed cannot, and its request keeps the resources of its workers reserved for 180 s
    (Ray Train's AUTOSCALING_REQUESTS_EXPIRE_TIME_S): a relaunch sized from the coordinator's view
    got 1 of 3 workers (seen in CI after a driver SIGKILL). This launch holds the run lease, so
    any earlier launch of the run is gone. Returns the requester whose reservation was
    released, if it held one (a launch that ended, or another Ray's, holds none); never
    raises."""
    mine = f"train-{run_id}"
    cancelled = None
    try:
        prev = folder.read(REQUEST_RECORD)
        if prev and prev.get("launch") != launch_id and prev.get("requester") not in (None, mine):
            actor = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
            held = ray.get(actor.get_reserved_resources.remote(prev["requester"]), timeout=5)
            ray.get(actor.cancel_request.remote(requester_id=prev["requester"]), timeout=5)
            if held:  # said only when it reserved something (a launch that ended had cancelled)
                cancelled = prev["requester"]
                log(
                    f"elastic: released the resources the previous launch {prev['launch']} had "
                    f"reserved with Ray ({cancelled}): it is gone",
                    flush=True,
                )
        folder.write(REQUEST_RECORD, {"launch": launch_id, "requester": mine})
    except Exception as e:  # never fail the run over it: the request expires by itself
        log(
            f"elastic: could not release the previous launch's resource request "
            f"({type(e).__name__}: {e}); it expires within 180 s",
            flush=True,
        )
    return cancelled


def run_job(train_run_context) -> Optional[JobConfig]:
    """The job of the run (cluster/launch.py hands it to the workers as train_loop_config's
    "job"); None, said, where it cannot be read: Ray's sizes then stand, and a group at a size
    train.context_parallel does not split ends with its workers' ConfigError."""
    try:
        return job_from_dict(train_run_context.train_loop_config["job"])
    except Exception as e:  # never fail the run over it
        print(
            f"elastic: cannot read the run's job from Ray's train_loop_config "
            f"({type(e).__name__}: {e}); group sizes are Ray's, unchecked against "
            "train.context_parallel",
            flush=True,
        )
        return None


def usable_nodes() -> list[dict]:
    """ray.nodes() entries of the alive nodes not being drained."""
    draining = set(ray._private.state.state.get_draining_nodes())
    return [n for n in ray.nodes() if n["Alive"] and n["NodeID"] not in draining]


def count_usable_nodes_only(
    policy_cls=ElasticScalingPolicy, startable: Optional[Callable[[int], int]] = None
) -> bool:
    """Wrap `policy_cls._count_possible_workers` (in this process: the controller's) so that its
    count never exceeds what the alive, non-draining nodes hold, and never drops below the size
    of the group running; then `startable(count)`: the largest size <= it the job can start at
    (ClusterView._startable: one train.context_parallel splits; a count below min_workers makes
    Ray wait, one equal to the running size leaves the group alone). False where the policy
    lacks the methods; calling it again is harmless (and sets `startable`).

    A cap, not a filter of the coordinator's reservation: the coordinator reserves the group's
    bundles (up to max_workers) on nodes of its own view, a draining node among them; leaving
    those out would also leave out a node it did not reserve because that one was reserved
    instead (two nodes joined while a preempted one lingered: the group grew onto one). And
    never below the running group's size: a node just told it will be preempted still runs its
    workers, which drain (checkpoint the step they are at) once Ray's preemption watcher tells
    them; a "resize" down to the other nodes would tear the group down first and lose the
    steps since the last snapshot."""
    count = getattr(policy_cls, "_count_possible_workers", None) if policy_cls else None
    running = getattr(policy_cls, "make_decision_for_running_worker_group", None)
    if count is None or running is None:
        return False
    policy_cls._startable = staticmethod(startable or (lambda n: n))
    if getattr(count, "_usable_nodes_only", False):
        return True

    @functools.wraps(count)
    def _count_possible_workers(self, reserved_resources):
        return self._startable(usable_count(self, count(self, reserved_resources)))

    @functools.wraps(running)
    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._running_size = worker_group_state.num_workers
        try:
            return running(self, worker_group_state, worker_group_status)
        finally:
            self._running_size = 0

    def usable_count(self, counted: int) -> int:
        per_worker = self.scaling_config._resources_per_worker_not_none
        if not any(v > 0 for v in per_worker.values()):
            return counted  # workers that need nothing fit anywhere
        try:
            fits = workers_that_fit(per_worker)
        except Exception:  # Ray's own count stands
            return counted
        return min(counted, max(fits, getattr(self, "_running_size", 0)))

    _count_possible_workers._usable_nodes_only = True
    policy_cls._count_possible_workers = _count_possible_workers
    policy_cls.make_decision_for_running_worker_group = make_decision_for_running_worker_group
    return True


def workers_that_fit(
    per_worker: dict[str, float],
    nodes: Optional[list[dict]] = None,
    draining: Optional[set[str]] = None,
) -> int:
    """Workers of `per_worker` resources that the alive nodes not being drained hold in total."""
    if nodes is None or draining is None:
        nodes, draining = usable_nodes(), set()
    needs = {k: v for k, v in per_worker.items() if v > 0}
    total = 0
    for node in nodes:
        if node["Alive"] and node["NodeID"] not in draining and needs:
            have = node["Resources"]
            total += int(min(have.get(k, 0.0) // v for k, v in needs.items()))
    return total
