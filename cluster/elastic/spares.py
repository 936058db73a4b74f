"""Spare worker processes, started and warmed ahead, so that a restarted group does not wait
for Python to import what training needs.

Ray Train starts every worker group in new processes: it kills the old group's actors, and an
actor never takes a process that ran anything else. In a new process, before a restarted group
can train, measured here (2-core VM, tiny model, worker crash):

    the worker process itself (python, ray, registering)            ~1 s
    Ray Train's worker module (ray.train.v2 ... worker_group.worker)  0.9 s
    our callbacks unpickled in it (cluster.config -> torch, ...)     3.0 s
    MLflow on rank 0 (mlflow, its sqlalchemy store)                  2.4 s
    torch._dynamo (torch.optim imports it on the first param group)  1.2 s

That is ~8 of a 10-11 s recovery. The raylet can start a job's worker processes ahead for a
given runtime env (its PrestartWorkers call, node_manager.proto: the one Ray's own task
submitter uses for backlogs); an actor created later with that runtime env takes such an idle
process instead of starting one. So, after each group's first step, every worker asks its own
node's raylet for one spare (`request_spares`). A node's workers so ask for as many as the node
runs; Ray Train's local ranks would not say that here: they group workers by IP, and the test
clusters' nodes share one. Each spare imports PRELOAD while it waits (`preload`, the
worker-process setup hook that `worker_runtime_env` puts in the train workers' runtime env).

Every process of that runtime env runs the hook, not only spares (it cannot tell them apart):
a process Ray starts for a worker actor, as at a group's first start, imports the same modules
before its actor runs, which it would have imported anyway, except MLflow on ranks other than 0
(~2 s of a core, in parallel with rank 0's own). Keepers are created from the workers and would
inherit the hook (and could take a spare): `apart()` is their runtime env without it.

Spares are the job's processes: Ray ends them with the job. Each holds the imports (about
0.45 GiB of host memory here; nothing on the GPU: the preload never touches CUDA, so a spare
learns its GPU from Ray like any new process). A spare nobody takes stays until the job ends;
a group that never restarts pays that memory and the CPU of importing once.
`cluster.spare_workers` (ClusterConfig) says where spares run: by default on GPU workers only.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Optional

HOOK = "cluster.elastic.spares.preload"
"""The worker-process setup hook (a module path Ray imports in each new process)."""

PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim's first add_param_group imports it: 1.2 s
    "ray.train.torch",
    "ray.train.v2._internal.execution.worker_group.worker",  # the actor's class
    "cluster.config",
    "cluster.elastic.drain",
    "cluster.elastic.faults",
    "cluster.elastic.grow",
    "cluster.elastic.leave",
    "cluster.elastic.tracker",
    "cluster.elastic.preemption",
    "cluster.elastic.clock",
    "cluster.elastic.hooks",
    "cluster.snapshots.keepers",
    "cluster.snapshots.keeper_fs",
    "cluster.worker",
    "trainer.loop",
    "trainer.checkpoint.checkpointer",
    "ray.tune.trainable.trainable_fn_utils",  # ray.train.report's: 0.3 s at the first report
    "ray._private.grpc_utils",  # request_spares
    "mlflow",  # rank 0 logs the run: 2.4 s with its store
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.system_metrics.system_metrics_monitor",
    "sqlalchemy.dialects.sqlite",
)
"""What a spare imports while it waits: what a worker process imported before its first step
(measured with PYTHONPROFILEIMPORTTIME in a restarted rank 0: what it imported after a
preload of this list came to about 0.1 s). tests/cluster/elastic/test_spares.py checks that
every one imports and that none touches CUDA; a module the worker path adds later is imported on the
critical path again, which benchmarks.recovery's imports column would show."""

KEEP_ALIVE_S = 7 * 24 * 3600
"""PrestartWorkers' keep_alive_duration_secs: how long the raylet keeps a spare even when its
idle processes exceed its soft limit (one per CPU). A spare waits for a failure that may come
days into a run; Ray ends it with its job in any case (tested)."""


def _hook_env_var() -> Optional[str]:
    try:
        from ray._private import ray_constants  # noqa: PLC0415 -- only where Ray runs

        return ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    except (ImportError, AttributeError):  # another Ray: no spares, nothing breaks
        return None


MARKERS_ENV = "EFSDP_SPARE_MARKERS"
"""In the train workers' runtime env: the run folder (a URI) where each process that preloaded
leaves a marker (spares/<node id>-<pid>.json), so the controller sees spares it asked a joined
node for become warm (`warm_joined_nodes`)."""
MARKERS_DIR = "spares"


def worker_runtime_env(markers: Optional[str] = None) -> dict:
    """RunConfig.worker_runtime_env: the setup hook in every train worker process. Ray's own
    `worker_process_setup_hook` field is read only by ray.init (job level), so the hook goes in
    as the env var that field becomes. Empty where this Ray has no such variable. `markers`:
    the run's elastic folder (URI), where preloaded processes leave their marker."""
    var = _hook_env_var()
    if not var:
        return {}
    return {"env_vars": {var: HOOK, **({MARKERS_ENV: markers} if markers else {})}}


def apart() -> dict:
    """The runtime env of actors the workers start that must not preload or take a spare (the
    snapshot keepers): the hook unset."""
    var = _hook_env_var()
    return {"env_vars": {var: ""}} if var else {}


def preload() -> None:
    """The setup hook: imports PRELOAD before the process takes any work. Ray runs it after
    the process registered with its raylet and before it runs a task, so an actor given the
    process meanwhile waits for it. Synchronous on purpose: importing on a thread while the
    actor imports the same packages on its own broke MLflow's circular imports ("cannot import
    name '_get_store' from partially initialized module 'mlflow.tracking'": the crash drill,
    when a group restarted in a spare still importing). Never raises (an error in a setup
    hook ends the worker process)."""
    _PRELOADED["began"] = time.time()
    import_all(PRELOAD)
    _PRELOADED["done"] = time.time()
    _set_title(TITLE)  # Ray titles the process anew when it runs its first task
    _leave_marker()


def _leave_marker() -> None:
    """spares/<node>-<pid>.json in the run folder: this process has preloaded (never raises)."""
    where = os.environ.get(MARKERS_ENV)
    if not where:
        return
    try:
        import ray  # noqa: PLC0415 -- preloaded

        from cluster.run.folder import RunFolder  # noqa: PLC0415 -- light

        node = ray.get_runtime_context().get_node_id()
        RunFolder.at(where).write(
            f"{MARKERS_DIR}/{node}-{os.getpid()}.json",
            {"node": node, "pid": os.getpid(), "warm": _PRELOADED["done"]},
        )
    except Exception:  # noqa: BLE001 -- a marker only
        pass


_PRELOADED: dict[str, float] = {}
"""When this process began and finished its preload (wall-clock times)."""

TITLE = "ray::IDLE (elastic-fsdp spare, warm)"
"""The process title (ps, top) of a process that has preloaded and has no work yet."""


def _set_title(title: str) -> None:
    try:
        import ray._raylet  # noqa: PLC0415

        ray._raylet.setproctitle(title)
    except Exception:  # noqa: BLE001 -- a title only
        pass


def match_torch_threads() -> Optional[int]:
    """In a preloaded process, size torch's intra-op thread pool as in a new one; returns the
    size set, or None. The preload imported torch before Ray set OMP_NUM_THREADS for the actor
    (the CPUs it was given), so torch sized its pool by the machine's cores: two ranks of one
    CPU each ran 2 threads each on this 2-core VM (steps 2x slower after a restart in spares).
    Call it in the actor, before training."""
    if "began" not in _PRELOADED:
        return None
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    import torch  # noqa: PLC0415 -- preloaded

    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
        return n
    return None


def this_process() -> Optional[dict]:
    """{"started", "preloaded"}: when this process's preload began (the process had just
    started) and ended; None where it ran none (spares off). A restarted group's rank whose
    process started before the failure ran in a spare."""
    if "began" not in _PRELOADED:
        return None
    return {"started": _PRELOADED["began"], "preloaded": _PRELOADED.get("done")}


def import_all(modules) -> list[str]:
    """Imports each module; returns those that failed (the process imports them itself when it
    needs them, and fails there if it must)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            failed.append(name)
    return failed


def request_spares(count: int = 1, keep_alive_s: float = KEEP_ALIVE_S) -> None:
    """Asks this node's raylet to start `count` idle worker processes with this worker's
    runtime env (and job), which the next group's actors on this node take. Raises on failure
    (the caller prints it once: spares only save time)."""
    import ray  # noqa: PLC0415

    ctx = ray.get_runtime_context()
    prestart(
        _raylet_address(ray, ctx.get_node_id()),
        ctx.get_job_id(),
        ctx.get_runtime_env_string(),
        count,
        keep_alive_s,
    )


def prestart(
    raylet: str, job_id: str, runtime_env: str, count: int, keep_alive_s: float = KEEP_ALIVE_S
) -> None:
    """PrestartWorkers on the raylet at `raylet` (host:port): `count` idle processes of the job
    `job_id` (hex) with the serialized `runtime_env`."""
    if count < 1:
        return
    from ray._private.grpc_utils import init_grpc_channel  # noqa: PLC0415
    from ray.core.generated import (  # noqa: PLC0415
        common_pb2,
        node_manager_pb2,
        node_manager_pb2_grpc,
        runtime_environment_pb2,
    )

    channel = init_grpc_channel(raylet)
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
            node_manager_pb2.PrestartWorkersRequest(
                language=common_pb2.PYTHON,
                job_id=bytes.fromhex(job_id),
                runtime_env_info=runtime_environment_pb2.RuntimeEnvInfo(
                    serialized_runtime_env=runtime_env
                ),
                keep_alive_duration_secs=int(keep_alive_s),
                num_workers=int(count),
            ),
            timeout=10,
        )
    finally:
        channel.close()


SPARE_ENV = "spare_env.json"
"""Written by rank 0 of each group (where spares are on): the job id and the serialized runtime
env of the train workers, which the controller needs to prestart spares on a joined node."""


def record_worker_env(folder, launch_id: str) -> None:
    """Rank 0: write SPARE_ENV (never raises: spares only save time)."""
    try:
        import ray  # noqa: PLC0415 -- in a worker: loaded

        ctx = ray.get_runtime_context()
        folder.write(
            SPARE_ENV,
            {
                "launch": launch_id,
                "job_id": ctx.get_job_id(),
                "runtime_env": ctx.get_runtime_env_string(),
            },
        )
    except Exception as e:  # noqa: BLE001
        print(f"elastic: cannot record the workers' runtime env ({type(e).__name__}: {e})")


def warm_joined_nodes(
    folder,
    launch_id: str,
    nodes: list[dict],
    per_node: dict[str, int],
    wait_s: float,
    clock=time.monotonic,
    sleep=time.sleep,
    start=prestart,
) -> Optional[str]:
    """Before a grow onto nodes that joined (no process of this job there yet): have each one's
    raylet start as many spares as it will run workers (`per_node`: node id -> workers), and
    wait up to `wait_s` (the running group trains on) until each node's spares left their
    marker, so the new group's actors there start in warm processes too. Returns a line saying
    what happened, or None when there was nothing to do (no joined node, spares not recorded)."""
    env = folder.read(SPARE_ENV)
    if not env or env.get("launch") != launch_id or not per_node:
        return None
    t0, asked = clock(), time.time()
    by_id = {n["NodeID"]: n for n in nodes}
    for node_id, count in per_node.items():
        n = by_id[node_id]
        start(
            f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}",
            env["job_id"],
            env["runtime_env"],
            count,
        )
    while True:
        warm = _warm_counts(folder, asked)
        cold = {k: c for k, c in per_node.items() if warm.get(k, 0) < c}
        if not cold or clock() - t0 >= wait_s:
            break
        sleep(0.25)  # markers are files other processes write: nothing to wait on
    took = clock() - t0
    total = sum(per_node.values())
    if cold:
        return (
            f"elastic: {total - sum(cold.values())} of {total} spare(s) on the joined node(s) "
            f"warm after {took:.1f} s; growing anyway (the rest start as new processes)"
        )
    return f"elastic: {total} spare(s) on the joined node(s) warm in {took:.1f} s"


def joined_node_warmer(folder, launch_id: str, cluster_cfg):
    """ClusterView's warm_joined for this launch: warm_joined_nodes bounded by
    cluster.grow_spares_wait_s."""

    def warm(nodes: list[dict], per_node: dict[str, int]) -> Optional[str]:
        return warm_joined_nodes(folder, launch_id, nodes, per_node, cluster_cfg.grow_spares_wait_s)

    return warm


def _warm_counts(folder, since: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    try:
        names = folder.names(MARKERS_DIR)
    except (FileNotFoundError, OSError):  # none yet
        return counts
    for name in names:
        doc = folder.read(name)
        if doc and doc.get("warm", 0) >= since:
            counts[doc["node"]] = counts.get(doc["node"], 0) + 1
    return counts


def _raylet_address(ray, node_id: str) -> str:
    from ray._common.network_utils import build_address  # noqa: PLC0415

    node = getattr(ray._private.worker.global_worker, "node", None)  # this process's raylet
    if node is not None and getattr(node, "node_manager_port", None):
        return build_address(node.node_ip_address, node.node_manager_port)
    for n in ray.nodes():  # a GCS call: only where the process does not know it
        if n["NodeID"] == node_id and n["Alive"]:
            return build_address(n["NodeManagerAddress"], n["NodeManagerPort"])
    raise RuntimeError(f"node {node_id} is not among Ray's live nodes")


class SpareRequest:
    """WorkerContext.before_step of every worker: at the group's second step (its first is
    done: the group's own start-up no longer competes for CPU), asks the node's raylet for
    `count` spares, on a thread. Once per group; a failure is printed once and training goes
    on."""

    def __init__(self, count: int = 1, request=request_spares):
        self.count, self._request = count, request
        self._first: Optional[int] = None
        self.thread: Optional[threading.Thread] = None

    def __call__(self, step: int) -> None:
        if self.thread is not None:
            return
        if self._first is None:
            self._first = step
            return
        self.thread = threading.Thread(target=self._run, name="spare-request", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._request(self.count)
        except Exception as e:  # noqa: BLE001 -- spares only save time
            print(
                f"elastic: could not start {self.count} spare worker process(es) on this node "
                f"({type(e).__name__}: {e}); a restart starts new ones",
                flush=True,
            )
