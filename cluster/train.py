"""The entry point: one command from a Hydra config to a trained, checkpointed, tracked model.

    python -m cluster.train                                   # the default job (conf/config.yaml)
    python -m cluster.train train.steps=200 cluster.num_workers=4 sharding=shard_grad_op
    python -m cluster.train -m sharding=full_shard,shard_grad_op,no_shard,hybrid_shard  # a sweep
    elastic-fsdp-train ...                                    # the same, as a console script

The story of one job, top to bottom: compose and validate the config (every bad value before
anything starts); join the cluster when the job names one and check it holds the job's workers
(cluster/capacity.py: one error in seconds, before anything is written); the preflight (the
data prepared here when small and checked against the run, the storage writable) and the run's
lease; start a local Ray otherwise (checked the same way) while the MLflow run is created in a
thread; find or prepare the data (on Ray Data for large sources); run the Ray Train V2
TorchTrainer (cluster/worker.py in each worker); log the loss curve, and say where the results
are. A launch that dies ends its MLflow run FAILED, or KILLED when interrupted (Ctrl-C, SIGTERM).
In a sweep (-m) each job is one such story; cluster/sweep.py checks all of them before the
first, starts Ray once, and makes each job's run a child of the sweep's parent run (the sweep,
not each job, says how to open it in the MLflow UI).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from cluster.address import joins_cluster
from cluster.compose import overrides_or_exit, register_schemas
from cluster.config import ConfigError, JobConfig, job_to_dict
from cluster.job_slot import JobSlot, current_slot, sweep_run_name
from cluster.launch import build_trainer, connect_for_jobs, ray_job_tags
from cluster.logs import quiet_libraries, tee_to_job_log, wait_for_workers_output
from cluster.preflight import already_complete, checked_config, preflight
from cluster.run.fatal import fatal_error
from cluster.run.layout import run_folder
from cluster.run.lease import LeaseHeld, LeaseLost, RunLease, ray_identity
from cluster.run.ray_checkpoint import read_pointer
from cluster.snapshots.lifecycle import for_launch
from cluster.tracking.job import data_metrics, finish_tracking, start_tracking
from cluster.tracking.runs import (
    end_abandoned_run,
    end_run,
    experiment_of,
    metric_history,
    ui_command,
    ui_url,
)
from cluster.worker import LaunchInfo, worker_config
from trainer.data.preparation import Plan
from trainer.metrics import MLflowLogger

register_schemas()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def hydra_main(dictcfg: DictConfig) -> Optional[dict]:
    slot = current_slot()  # this job's place in a sweep; None for a plain run
    # What the console shows also lands in the job's Hydra log file; in a sweep every line
    # (the workers' too, which Ray forwards through this process) says which job it is of.
    with tee_to_job_log(prefix=slot.prefix if slot else ""):
        return run_job(dictcfg, slot)


def run_job(dictcfg: DictConfig, slot: Optional[JobSlot]) -> Optional[dict]:
    startup = Startup()  # the driver's phases; rank 0 prints them with the workers' own
    exit_on_sigterm()  # `ray job stop`, Kubernetes: the run is ended KILLED (ray.init does same)
    launch_dir = os.getcwd()  # hydra.job.chdir is false: this is where the user launched
    out_dir = HydraConfig.get().runtime.output_dir  # this job's Hydra outputs
    cfg = config_or_exit(dictcfg, launch_dir, slot)  # every bad value stops here
    complete = already_complete(cfg)  # a second `make run`: nothing to train, no empty run
    if complete:
        print(complete)
        return None
    quiet_libraries(cfg.cluster.verbose)  # the workers do the same (cluster/worker.py)
    startup.done("config")
    joins = joins_cluster(cfg.cluster)
    if joins:  # the cluster first: one that is absent or cannot hold the job leaves no file
        connect_for_jobs([cfg])
        startup.done("Ray")
    plan = preflight_or_exit(cfg)  # the data (prepared here when small), the storage
    lease = lease_or_exit(cfg)  # this launch owns the run name until it ends
    startup.done("preflight")
    tracking = TrackingStart(cfg, slot, out_dir)  # MLflow's run, in a thread while Ray starts
    result, fatal, run_id = None, None, None
    try:
        if not joins:  # a local Ray: started once the cheap checks passed (it takes seconds)
            connect_for_jobs([cfg])
            startup.done("Ray")
        lease.renew(**ray_identity())  # a relaunch can ask Ray whether this driver still lives
        data = prepare(cfg, plan)  # once; on Ray Data for large sources
        startup.done("data")
        run_id = tracking.run_id()
        log_launch(cfg, run_id, data)
        adopt_run(cfg, lease, run_id)
        startup.done("MLflow")
        try:
            result = fit(cfg, run_id, data.uri, lease.holder.launch_id, startup, died_before(lease))
            fatal = fatal_error(cfg.cluster, lease.holder.launch_id)
        except Exception:  # the summary and the curve of what it logged, then FAILED
            if run_id:
                finish_tracking(cfg, run_id, slot, out_dir, ok=False)
            raise
        if run_id:
            finish_tracking(cfg, run_id, slot, out_dir, ok=fatal is None)
    except BaseException as e:  # Ctrl-C, SIGTERM, or the launch died before its run ended
        # KILLED at once, no summary: `ray job stop` sends SIGKILL 3 s after its SIGTERM
        end_unfinished(cfg, tracking, run_id, e)
        raise
    finally:
        lease.release()
    if lease.lost:
        print(f"error: {lease.lost} while this launch ran", file=sys.stderr)
    if fatal:  # the workers stopped for good (not retried): say why, exit 1
        print(f"error: {fatal}", file=sys.stderr)
        sys.exit(1)
    return closing_note(cfg, run_id, result, see_it=slot is None)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so that a terminated launch still ends
    its MLflow run and releases its lease (Python's default would die at once). ray.init
    installs the same (SystemExit(15)) for its own time."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


class TrackingStart:
    """start_tracking (the run, its params and artifacts) in a thread, begun once the preflight
    passed: MLflow's import and its store's set-up (seconds each on a busy machine) overlap
    Ray's start. `run_id()` waits for it (and raises what it raised)."""

    def __init__(self, cfg: JobConfig, slot: Optional[JobSlot], out_dir: str):
        self.value: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(
            target=self._start, args=(cfg, slot, out_dir), name="mlflow-start", daemon=True
        )
        self.thread.start()

    def _start(self, cfg: JobConfig, slot: Optional[JobSlot], out_dir: str) -> None:
        try:
            self.value = start_tracking(cfg, slot, out_dir)
        except BaseException as e:  # handed to the main thread
            self.error = e

    def run_id(self) -> Optional[str]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def log_launch(cfg: JobConfig, run_id: Optional[str], data) -> None:
    """The prepared data and the Ray job on the run: the data's digest, folder and size, the Ray
    job's id (and its submission id under `ray job submit`), where the code came from."""
    if not run_id:
        return
    logger = MLflowLogger(cfg.tracking.tracking_uri, run_id)
    logger.set_tags({"data.digest": data.digest, "data.dir": data.uri, **ray_job_tags()})
    logger.log_metrics(data_metrics(data), step=0)


def end_unfinished(
    cfg: JobConfig, tracking: TrackingStart, run_id: Optional[str], error: BaseException
) -> None:
    """The launch dies before its run ended (Ray unreachable or too small, an error, Ctrl-C,
    SIGTERM): end the run KILLED when interrupted, else FAILED, so none stays RUNNING."""
    signalled = (0, None, signal.SIGTERM, 128 + signal.SIGTERM)  # Ray's handlers exit with these
    interrupted = isinstance(error, KeyboardInterrupt) or (
        isinstance(error, SystemExit) and error.code in signalled
    )
    try:
        run_id = run_id or tracking.run_id()
        if run_id and run_state(cfg.tracking.tracking_uri, run_id) == "RUNNING":
            status = "KILLED" if interrupted else "FAILED"
            end_run(cfg.tracking.tracking_uri, run_id, ok=False, status=status)
            print(f"mlflow: run {run_id} marked {status}", file=sys.stderr, flush=True)
    except Exception as e:  # the launch's own error is what the user must see
        print(f"warning: mlflow run not ended ({type(e).__name__}: {e})", file=sys.stderr)


def run_state(tracking_uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- imported already by then

    return MlflowClient(tracking_uri).get_run(run_id).info.status


def lease_or_exit(cfg: JobConfig) -> RunLease:
    """The run name's lease (cluster/run/lease.py), heartbeating; or exit 2 naming the launch that
    holds it. Before Ray and MLflow: a refused launch leaves nothing behind."""
    try:
        lease = RunLease.acquire(
            run_folder(cfg.cluster.storage_path, cfg.cluster.run_name),
            takeover=cfg.cluster.takeover,
            ttl_s=cfg.cluster.lease_ttl_s,
            wait_s=cfg.cluster.wait_for_lease_s,
        )
    except (LeaseHeld, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    lease.start_heartbeat()
    return lease


def adopt_run(cfg: JobConfig, lease: RunLease, run_id: Optional[str]) -> None:
    """Record this launch's MLflow run in the lease; a previous launch of this name that died
    without ending its MLflow run (its lease expired or was taken over) has it ended as KILLED,
    so the UI shows no run running forever and no step in two running runs."""
    prev = lease.previous
    abandoned = prev is not None and not prev.released and prev.mlflow_run_id
    if abandoned and prev.mlflow_run_id != run_id:
        if end_abandoned_run(cfg.tracking.tracking_uri, prev.mlflow_run_id, lease.holder.launch_id):
            print(
                f"mlflow: run {prev.mlflow_run_id} of the previous launch {prev.launch_id} "
                "(gone without ending it) marked KILLED"
            )
    try:
        lease.renew(mlflow_run_id=run_id)
    except (LeaseLost, OSError) as e:  # the heartbeat reports a loss; storage hiccups retry
        print(f"warning: run lease: {e}", file=sys.stderr)


def main() -> None:
    """Console script `elastic-fsdp-train`; Hydra reads the overrides from sys.argv, once each
    key is known to exist (a typo gets "did you mean", not Hydra's advice to add it with +)."""
    overrides_or_exit(sys.argv[1:])
    hydra_main()


def config_or_exit(dictcfg: DictConfig, launch_dir: str, slot: Optional[JobSlot]) -> JobConfig:
    """Typed, validated, with absolute paths (and a sweep job's own run name); or exit 2 with
    the message: nothing has been written, Ray has not started, no MLflow run exists. (A
    sweep's jobs were all checked the same way before the first one started.)"""
    try:
        run_name = sweep_run_name(dictcfg.cluster.run_name, slot) if slot else None
        return checked_config(dictcfg, launch_dir, run_name)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def preflight_or_exit(cfg: JobConfig) -> Plan:
    """The preflight (cluster/preflight.py: the prepared data intact and enough for the run,
    the storage writable) and the data's preparation plan; or exit 2 with the message. It is
    the first step that writes (the data prepared here, the storage's probe): it runs after the
    cluster a job joins was found to hold it."""
    try:
        return preflight(cfg)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def prepare(cfg: JobConfig, plan: Plan):
    """Tokenize the sources once (cluster/prepare.py); later runs find the preparation. Data
    prepared on Ray Data that cannot serve this run stops it here, before any worker starts."""
    from cluster.prepare import prepare_data  # noqa: PLC0415 -- torch: after the config checks

    try:
        return prepare_data(cfg, plan)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class Startup:
    """The driver's start-up phases, timed: (name, seconds) in order, and when it began. The
    workers' rank 0 adds its own (cluster/elastic/tracker.py) and prints the whole on one line
    once the first step is done."""

    def __init__(self):
        self.began = self._last = time.time()
        self.phases: list[list] = []

    def done(self, name: str) -> None:
        now = time.time()
        self.phases.append([name, now - self._last])
        self._last = now

    def handed_over(self) -> dict:
        """For LaunchInfo.startup: the phases so far and the time the trainer is started."""
        return {"began": self.began, "phases": self.phases, "fit_at": time.time()}


def fit(
    cfg: JobConfig,
    run_id: Optional[str],
    data_dir: str,
    launch_id: str,
    startup: Optional[Startup] = None,
    previous_launch_id: Optional[str] = None,
):
    """Run the TorchTrainer to completion; Ray retries failures up to cluster.max_failures (the
    workers end cleanly on errors a retry would repeat: cluster/run/fatal.py)."""
    import ray.train.torch  # noqa: F401, PLC0415 -- seconds to import: a start-up phase of its own

    if startup is not None:
        startup.done("Ray Train import")
    snapshots = for_launch(cfg, launch_id, previous_launch_id)  # and a dead launch's, to read
    launch = LaunchInfo(
        checkpoint_root=cfg.checkpoint_root,
        mlflow_run_id=run_id,
        data_dir=data_dir,
        launch_id=launch_id,
        startup=startup.handed_over() if startup else None,
        previous_launch_id=snapshots.previous_launch_id,
    )
    trainer = build_trainer(cfg, worker_config(job_to_dict(cfg), launch))
    try:
        result = trainer.fit()
    finally:  # the in-memory snapshots live as long as this launch (an inherited one's too)
        snapshots.stop()
    wait_for_workers_output(launch_id)  # their last lines before the closing note (or next job)
    return result


def died_before(lease: RunLease) -> Optional[str]:
    """The launch id of the run's previous launch if it ended without releasing its lease (its
    driver killed, or lost with its node); its detached snapshot keepers outlived it."""
    prev = lease.previous
    if prev is None or prev.released or prev.launch_id == lease.holder.launch_id:
        return None
    return prev.launch_id


def closing_note(cfg: JobConfig, run_id: Optional[str], result, see_it: bool = True) -> dict:
    """Print where everything is and return it (Hydra keeps a multirun's return values). The
    "see it" lines (how to open the run in the MLflow UI) only when `see_it`: a sweep's jobs
    leave them to the sweep, which names its parent run once, at its end."""
    uri = cfg.tracking.tracking_uri
    pointer = read_pointer(result.checkpoint) or {}
    losses = metric_history(uri, run_id, "train/loss") if run_id else []
    restarts = metric_history(uri, run_id, "elastic/restarts") if run_id else []
    lost = metric_history(uri, run_id, "elastic/steps_lost") if run_id else []
    note = {
        "last_step": pointer.get("step"),
        "checkpoint": pointer.get("checkpoint"),
        "checkpoint_root": cfg.checkpoint_root,
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "mlflow_run_id": run_id,
        "tracking_uri": uri,
        "experiment": cfg.tracking.experiment,
        "restarts": int(restarts[-1][1]) if restarts else 0,
        "steps_lost": int(sum(v for _, v in lost)),
    }
    print("\n== done ==")
    if losses:
        print(
            f"loss:       {_fmt(note['first_loss'])} at step {losses[0][0]} -> "
            f"{_fmt(note['final_loss'])} at step {losses[-1][0]}"
        )
    if note["restarts"]:
        print(
            f"elastic:    {note['restarts']} worker-group restarts, {note['steps_lost']} steps "
            "trained again"
        )
    print(
        f"checkpoint: {note['checkpoint'] or 'none reported'} (this run's checkpoints are "
        f"under {cfg.checkpoint_root})"
    )
    if run_id:
        print(f"mlflow run: {run_id} in experiment '{cfg.tracking.experiment}', tracking URI {uri}")
    if run_id and see_it:
        print(see_it_lines(uri, run_id))
    sys.stdout.flush()
    return note


def see_it_lines(tracking_uri: str, run_id: str) -> str:
    """How to open a run in the MLflow UI: the command that serves the store, then the page."""
    page = ui_url(tracking_uri, experiment_of(tracking_uri, run_id), run_id)
    return f"see it:     {ui_command(tracking_uri)}\n            then {page}"


def _fmt(loss) -> str:
    return "?" if loss is None else f"{loss:.4f}"


if __name__ == "__main__":
    main()
