"""Elasticity inside each Ray Train worker: fault drills, graceful drain, and the elastic/* metrics.

Ray Train restarts the worker group when a worker dies or a node leaves, and (elastic
min..max runs) when nodes join; each new group resumes from the newest checkpoint at its own world
size (trainer/loop.py). This file adds what the loop cannot know by itself, through the
WorkerContext callbacks that cluster/worker.py wires up:

- `FaultInjector` (ctx.fault): before step s, rank r crashes (os._exit) or is drained (SIGTERM).
  It fires once per run: a marker is written to the run folder before it fires, so the restarted
  group, or the same run submitted again, trains through step s.
- `DrainWatcher` (ctx.should_stop): a SIGTERM to the worker (Kubernetes, a spot reclaim, the
  drill above) or Ray's preemption notice (what ray.train.get_preemption_info returns) makes the
  loop commit a checkpoint of the current step and leave, so a graceful leave loses no step. The
  handler is installed in each worker's main thread by `SigtermCallback` (Python only lets that
  thread); `leave` then ends the process of a rank that was asked to go.
- `ClusterView` (a Ray Train controller callback, elastic runs only): Ray sizes an elastic
  group from a view of the nodes it renews every 20 s and that counts nodes being drained: a
  restart after a node loss or a preemption would ask for the leaving node and wait out the
  group start timeout (60 s), a node that joined would wait up to 20 s. The callback renews the
  view when it matters and keeps leaving nodes out of the decision.
- `ElasticTracker` (ctx.on_step, rank 0): one small JSON record per worker-group start, from
  which come elastic/restarts, elastic/recovery_s (the failure to the first step after the
  resume) and elastic/steps_lost, and a line saying where the recovery time went.

The run folder is Ray Train's (<storage_path>/<run_name>, a local path or any pyarrow filesystem):

    elastic/fault.json                the fired fault: kind, rank, step, time
    elastic/attempts/<start ns>.json  one worker-group start: launch, world size, start step,
                                      progress (last step trained and when), recovery figures
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from typing import Callable, Optional

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerCallback

from trainer.checkpoint.storage import Location, list_dir, read_bytes, resolve, write_atomic
from trainer.config import FaultConfig

ELASTIC_DIR = "elastic"
FAULT_MARKER = "fault.json"
ATTEMPTS_DIR = "attempts"
DRAIN_ACK_TIMEOUT_S = 60.0
"""How long a drain drill waits for the worker's SIGTERM handler to run (it runs in the main
thread, which takes signals between Ray's health-check polls: RAY_TRAIN_HEALTH_CHECK_INTERVAL_S)."""


class DrainedError(RuntimeError):
    """Raised by a worker that left early and gracefully: Ray Train then restarts the group.

    Returning normally would tell Ray the training is finished; an error makes it restart the
    group (counted against FailureConfig.max_failures) from the checkpoint just committed."""


# ---- the run folder ---------------------------------------------------------------------------

class RunFolder:
    """Small JSON documents under one folder of a pyarrow filesystem; unreadable ones read as None."""

    def __init__(self, location: Location):
        self.location = location

    @classmethod
    def of_ray_run(cls, storage) -> "RunFolder":
        """The elastic/ folder of Ray Train's run folder (ray.train.get_context().get_storage())."""
        return cls(resolve(f"{storage.experiment_fs_path}/{ELASTIC_DIR}", storage.storage_filesystem))

    @classmethod
    def at(cls, path_or_uri: str) -> "RunFolder":
        return cls(resolve(path_or_uri))

    def read(self, name: str) -> Optional[dict]:
        try:
            return json.loads(read_bytes(self.location.child(name)))
        except (FileNotFoundError, ValueError):
            return None

    def write(self, name: str, doc: dict, durable: bool = False) -> None:
        """Readers see the old or the new document, never a torn one (tmp + rename on local disks,
        one PUT on object stores). `durable` also fsyncs: for what must survive an os._exit."""
        loc = self.location.child(name)
        self.location.fs.create_dir(loc.path.rsplit("/", 1)[0], recursive=True)
        data = json.dumps(doc, sort_keys=True).encode()
        if durable or not loc.is_local:
            write_atomic(loc, data)
            return
        tmp = f"{loc.path}.tmp-{uuid.uuid4().hex}"
        with loc.fs.open_output_stream(tmp, compression=None) as f:
            f.write(data)
        loc.fs.move(tmp, loc.path)

    @property
    def is_local(self) -> bool:
        return self.location.is_local

    def exists(self, name: str) -> bool:
        return name in list_dir(self.location)

    def names(self, subdir: str) -> list[str]:
        """Sorted names ('subdir/x.json') of the JSON documents in `subdir`, temporaries left out."""
        return sorted(f"{subdir}/{n}" for n in list_dir(self.location.child(subdir)) if n.endswith(".json"))


# ---- graceful drain ---------------------------------------------------------------------------

class _Sigterm:
    """This worker process's view of SIGTERM. A SIGTERM is a graceful-drain request only while the
    loop is training (`training`) and Ray is not tearing the group down (`teardown`): then there
    is a step to checkpoint. Otherwise, or at a second SIGTERM, the previous handler runs (Ray's
    exits the process at once): holding on would only keep the worker's CPU/GPU from the next
    group until Ray escalates to SIGKILL (seen here: the next group waited 30 s for its CPU)."""

    requested = threading.Event()
    training = False
    teardown = False
    previous = signal.SIG_DFL


def install_sigterm_handler() -> None:
    """Take over SIGTERM in this process. Must run in its main thread (Python's rule)."""
    _Sigterm.previous = signal.getsignal(signal.SIGTERM)
    _Sigterm.requested.clear()
    _Sigterm.training = _Sigterm.teardown = False
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    if _Sigterm.training and not _Sigterm.teardown and not _Sigterm.requested.is_set():
        _Sigterm.requested.set()
        print(f"pid {os.getpid()}: SIGTERM: checkpointing the current step before leaving", flush=True)
        return
    previous = _Sigterm.previous
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, previous)
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def training():
    """Around run_training in the worker: the span in which a SIGTERM means "checkpoint, then go"."""
    _Sigterm.training = True
    try:
        yield
    finally:
        _Sigterm.training = False


WORKER_TIMES: dict[str, float] = {}
"""Per worker process: 'context' = when Ray had created this worker and its train context."""


class SigtermCallback(WorkerCallback):
    """Ray Train worker callback. Its hooks run as actor tasks in each worker process's main
    thread (the training function runs in another), the one thread that may install a signal
    handler. `before_worker_shutdown` is Ray tearing the group down (a restart or a resize):
    the SIGTERM that follows it must end the process at once."""

    def after_init_train_context(self):
        WORKER_TIMES["context"] = time.time()
        install_sigterm_handler()

    def before_worker_shutdown(self):
        _Sigterm.teardown = True


class DrainWatcher:
    """WorkerContext.should_stop: True once a SIGTERM arrived or Ray announced a preemption.

    `preemption_info` returns Ray's notice or None (`preemption_notice()` under Ray). It is
    called on every poll, even once the answer is known: the public ray.train.get_preemption_info
    is a barrier across the workers, so every rank must call it as often as the others (the loop
    polls once per step on every rank, then agrees across ranks with a MAX all-reduce)."""

    def __init__(self, rank: int, preemption_info: Optional[Callable[[], object]] = None):
        self.rank = rank
        self.preemption_info = preemption_info
        self.reason: Optional[str] = None
        self.leaving = False
        """This process itself must go (it got the SIGTERM, or its node is being preempted);
        the other ranks only stop because it does."""

    def __call__(self) -> bool:
        info = self.preemption_info() if self.preemption_info is not None else None
        if self.reason is None:
            if _Sigterm.requested.is_set():
                self.reason, self.leaving = "SIGTERM", True
            elif info is not None:
                self.reason = (f"Ray preemption notice for ranks {list(info.preempted_ranks)} "
                               f"(deadline {info.deadline_ms} ms)")
                self.leaving = self.rank in info.preempted_ranks
            if self.reason is not None:
                print(f"rank {self.rank}: {self.reason}: leaving after a checkpoint of this step", flush=True)
        return self.reason is not None

    @staticmethod
    def wait_for_sigterm(timeout: float) -> bool:
        return _Sigterm.requested.wait(timeout)


def leave(drain: DrainWatcher, message: str, exit_process: Callable[[int], None] = os._exit) -> None:
    """After a graceful stop (the checkpoint is committed): end the run of this worker group.

    A rank that was itself asked to go ends its process: its node (drained or preempted) then
    goes idle, and its raylet exits, so the next group is sized without it. The other ranks
    raise DrainedError: returning would tell Ray that training is finished."""
    if drain.leaving:
        print(f"{message}; this process exits", flush=True)
        exit_process(0)
        return  # only a test's exit_process returns
    raise DrainedError(message)


def preemption_notice() -> Callable[[], object]:
    """This worker's copy of Ray's preemption notice, read without a barrier.

    ray.train.get_preemption_info() is a barrier across the workers: an actor round trip for
    every rank, 2.7 ms per call measured here, every step. Ray's PreemptionWatcher hands the same
    notice to every worker, and the loop already agrees on stopping with one MAX all-reduce, so
    the local copy is enough. Where Ray's internals differ, the public call is used."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context()
        context.preemption_context.preemption_info  # noqa: B018 -- probe the attribute path
        return lambda: context.preemption_context.preemption_info
    except (ImportError, AttributeError):
        import ray.train

        return ray.train.get_preemption_info


# ---- the controller's view of the cluster ----------------------------------------------------

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
      The policy also caches the coordinator's answer for 1 s (GET_RESERVED_RESOURCES_INTERVAL_S),
      and its last read may be the running group's resize check just before the failure: so a
      restart first waits that second out.
    - The coordinator counts a node being drained (a preemption) as available until its raylet
      exits, so the restart after a preemption asks for the leaving node's workers too.
      `before_controller_execute_resize_decision` lowers the decision to what the alive,
      non-draining nodes hold (never below min_workers, never higher than Ray decided).

    Its hooks never raise (Ray would count a callback error as a failure of the run): an error in
    the renewal switches it off, Ray's own tick still works; the clipping falls back to Ray's
    decision."""

    def __init__(self, interval_s: float, min_workers: int):
        self.interval_s, self.min_workers = interval_s, min_workers
        self._last = float("-inf")
        self._off = False

    def after_controller_start(self, train_run_context) -> None:
        self._refresh()

    def after_controller_state_update(self, previous_state, current_state) -> None:
        kind = type(current_state).__name__
        if kind == "RestartingState":
            time.sleep(self._policy_cache_s())
            self._refresh()
        elif kind == "ReschedulingState":
            self._refresh()
        elif kind == "RunningState" and time.monotonic() - self._last >= self.interval_s:
            self._refresh()

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        try:
            fits = workers_that_fit(resize_decision.resources_per_worker)
        except Exception:  # Ray's decision stands
            return
        if self.min_workers <= fits < resize_decision.num_workers:
            print(f"elastic: Ray chose {resize_decision.num_workers} workers, but the nodes not being "
                  f"drained hold {fits}: starting {fits}", flush=True)
            resize_decision.num_workers = fits

    @staticmethod
    def _policy_cache_s() -> float:
        try:
            from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
        except ImportError:
            return 1.0
        return float(getattr(ElasticScalingPolicy, "GET_RESERVED_RESOURCES_INTERVAL_S", 1.0))

    def _refresh(self) -> None:
        if self._off:
            return
        self._last = time.monotonic()
        try:
            import ray

            actor = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
            ray.get(actor.get_reserved_resources.remote("elastic-fsdp-view", recompute=True), timeout=5)
        except Exception as e:  # never fail the run over an optimisation
            self._off = True
            print(f"elastic: cannot renew Ray's cluster view ({type(e).__name__}: {e}); "
                  "node changes are seen on Ray's 20 s tick", flush=True)


def workers_that_fit(per_worker: dict[str, float], nodes: Optional[list[dict]] = None,
                     draining: Optional[set[str]] = None) -> int:
    """Workers of `per_worker` resources that the alive nodes not being drained hold in total."""
    if nodes is None or draining is None:
        import ray

        nodes = ray.nodes()
        draining = set(ray._private.state.state.get_draining_nodes())
    needs = {k: v for k, v in per_worker.items() if v > 0}
    total = 0
    for node in nodes:
        if node["Alive"] and node["NodeID"] not in draining and needs:
            have = node["Resources"]
            total += int(min(have.get(k, 0.0) // v for k, v in needs.items()))
    return total


# ---- fault injection --------------------------------------------------------------------------

class FaultInjector:
    """WorkerContext.fault: config `fault` (kill_rank, at_step, kind) fired once per run.

    The marker is written durably before the fault fires; a restarted group, or the same run
    submitted again, finds it and trains step at_step like any other."""

    def __init__(self, fault: FaultConfig, rank: int, folder: RunFolder,
                 exit_process: Callable[[int], None] = os._exit):
        self.fault, self.rank, self.folder = fault, rank, folder
        self.exit_process = exit_process

    def __call__(self, step: int) -> None:
        f = self.fault
        if not f.enabled or self.rank != f.kill_rank or step != f.at_step:
            return
        if self.folder.exists(FAULT_MARKER):
            return
        self.folder.write(FAULT_MARKER, {"kind": f.kind, "rank": self.rank, "step": step,
                                         "time": time.time(), "pid": os.getpid()}, durable=True)
        print(f"fault injection: {f.kind} of rank {self.rank} before step {step}", flush=True)
        if f.kind == "crash":
            self.exit_process(1)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs in the main thread; wait for it, so the drill drains at this step.
            DrainWatcher.wait_for_sigterm(DRAIN_ACK_TIMEOUT_S)


# ---- elastic metrics --------------------------------------------------------------------------

class ElasticTracker:
    """Rank 0's record of this worker-group start, and the elastic/* metrics derived from it.

    The record is created at the start of the training function (`entered`), learns the start
    step at the first `before_step` (after the loop resumed), and its progress (last step
    trained, when) at every step. The next group start reads it to know what was lost:

        steps_lost  = last step the previous group trained + 1 - the step this group resumes at
        recovery_s  = first step done after the resume - the failure, where the failure is the
                      fired fault's time, or else the end of the previous group's last step
                      (an upper bound by at most one step for deaths nobody announced)

    A group that died before reporting its own recovery passes it on to the next one, so the
    figures span a failed restart. restarts counts the group starts of this launch (one
    `python -m cluster.train`); recovery_s is only reported within a launch, steps_lost also
    across a resubmission.

    On a local or shared disk the record is rewritten every step (a rename, well under a
    millisecond). On an object store each write is a PUT of tens of milliseconds, so progress
    is written at most every PROGRESS_EVERY_S there: steps_lost can then miss the steps of the
    last such interval before an unannounced death.
    """

    PROGRESS_EVERY_S = 1.0

    def __init__(self, folder: RunFolder, rank: int, world_size: int, launch_id: str,
                 times: dict[str, Optional[float]], clock: Callable[[], float] = time.time):
        """`times`: 'context' (Ray created the worker, SigtermCallback), 'entered' (the training
        function started: Ray's backend set up the process group in between), 'imported' (the
        training stack is imported and the logger attached)."""
        self.folder, self.clock = folder, clock
        self.active = rank == 0
        self.name = f"{ATTEMPTS_DIR}/{time.time_ns():020d}.json"
        entered = times["entered"]
        self.record = {"launch": launch_id, "world_size": world_size, "pid": os.getpid(), "started": entered,
                       "context": times.get("context") or entered, "imported": times.get("imported") or entered,
                       "start_step": None, "last_step": None, "last_step_time": None, "pending": None}
        self.previous: Optional[dict] = None
        self.trained_before = -1
        """The last step any earlier group trained: steps up to it are trained again here."""
        self.restarts = 0
        self._save_every_s = 0.0 if folder.is_local else self.PROGRESS_EVERY_S
        self._saved_at = float("-inf")
        if self.active:
            self._load_history()
            self._save()

    def _load_history(self) -> None:
        earlier = [d for d in (self.folder.read(n) for n in self.folder.names(ATTEMPTS_DIR)) if d]
        self.restarts = sum(d.get("launch") == self.record["launch"] for d in earlier)
        begun = [d for d in earlier if d.get("start_step") is not None]
        self.previous = begun[-1] if begun else None
        self.trained_before = max((d["last_step"] for d in begun), default=-1)

    def _save(self, progress_only: bool = False) -> None:
        now = time.monotonic()
        if progress_only and now - self._saved_at < self._save_every_s:
            return
        self.folder.write(self.name, self.record)
        self._saved_at = now

    # -- callbacks ----------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Chained into WorkerContext.fault: called before every step with its number."""
        if not self.active:
            return
        if self.record["start_step"] is None:
            self._begin(step)
        elif step - 1 > self.record["last_step"]:
            self._progress(step - 1)

    def on_step(self, step: int, metrics: dict) -> Optional[dict]:
        """WorkerContext.on_step: progress, and the elastic/* metrics for rank 0 to log."""
        if not self.active:
            return None
        if step <= self.trained_before and "train/loss" in metrics:
            # Kept to compare with the first training of the step (MLflow keeps only that one).
            self.record.setdefault("retrained_losses", {})[str(step)] = float(metrics["train/loss"])
        self._progress(step, save=False)
        out = {"elastic/restarts": float(self.restarts)}
        pending = self.record["pending"]
        if pending is not None:
            out["elastic/steps_lost"] = float(pending["steps_lost"])
            if pending.get("recovery_s") is not None:
                out["elastic/recovery_s"] = pending["recovery_s"]
            self.record["recovery"], self.record["pending"] = pending, None
        self._save(progress_only=pending is None)
        return out

    def left(self, step: int) -> None:
        """The loop returned early (a drain): note where, for the record."""
        if self.active:
            self.record["left_at"] = {"step": step, "time": self.clock()}
            self._save()

    # -- bookkeeping --------------------------------------------------------------------------
    def _begin(self, step: int) -> None:
        r = self.record
        r["start_step"], r["ready"], r["last_step"] = step, self.clock(), step - 1
        if self.previous is not None:
            r["pending"] = self._recovery_from(self.previous, step)
        self._save()

    def _progress(self, step: int, save: bool = True) -> None:
        r = self.record
        if r["start_step"] is None:
            self._begin(step)
        now = self.clock()
        r["last_step"], r["last_step_time"] = step, now
        pending = r["pending"]
        first_done = pending is not None and pending.get("first_step") is None
        if first_done:
            pending["first_step"] = now
            self._finish_recovery(pending)
        if save:
            self._save(progress_only=not first_done)

    def _recovery_from(self, prev: dict, start_step: int) -> dict:
        carried = prev.get("pending") or {}
        lost = carried.get("steps_lost", 0) + max(0, prev["last_step"] + 1 - start_step)
        failure = carried.get("failure")
        if failure is None:
            failure = self._failure_time(prev)
        same_launch = prev.get("launch") == self.record["launch"]
        return {"steps_lost": lost, "failure": failure if same_launch else None,
                "resumed_at": start_step, "first_step": None}

    def _failure_time(self, prev: dict) -> float:
        marker = self.folder.read(FAULT_MARKER)
        if marker and marker["time"] >= prev["started"]:
            return marker["time"]
        return prev.get("last_step_time") or prev.get("ready") or prev["started"]

    def _finish_recovery(self, pending: dict) -> None:
        """Where the time from the failure to the first step went, and one line saying so."""
        r, failure = self.record, pending["failure"]
        lost = f"{pending['steps_lost']} step{'s' if pending['steps_lost'] != 1 else ''} lost"
        if failure is None:
            pending["recovery_s"] = None
            print(f"elastic: resumed at step {pending['resumed_at']} at world size {r['world_size']} "
                  f"(a new launch of this run); {lost}", flush=True)
            return
        pending["recovery_s"] = pending["first_step"] - failure
        pending["breakdown"] = {
            "ray_restart_s": r["context"] - failure,  # detection, teardown, placement, new actors
            "process_group_s": r["started"] - r["context"],  # Ray's backend setup: the torch group
            "imports_s": r["imported"] - r["started"],  # torch, the trainer, MLflow
            "build_and_load_s": r["ready"] - r["imported"],  # model, data, checkpoint load
            "first_step_s": pending["first_step"] - r["ready"],
        }
        parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in pending["breakdown"].items())
        print(f"elastic: restart {self.restarts} at world size {r['world_size']}, resumed at step "
              f"{pending['resumed_at']}; {lost}; recovery {pending['recovery_s']:.1f} s ({parts})",
              flush=True)


def chain(*hooks: Optional[Callable[[int], None]]) -> Callable[[int], None]:
    """One WorkerContext.fault from several before-step hooks, called in order."""
    active = [h for h in hooks if h is not None]

    def before_step(step: int) -> None:
        for hook in active:
            hook(step)

    return before_step
