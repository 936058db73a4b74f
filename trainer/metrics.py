"""MLflow tracking for one training job, Ray-free.

The driver creates the run once (`create_run`) and passes its id to the workers; rank 0 attaches
to it with `MLflowLogger` and every other rank gets a `NullLogger`, so the loop never asks
"am I rank 0?" before logging. Workers never start a run of their own: a restarted worker group
(elastic resize, failure) keeps logging into the same run, keyed by the global optimizer step, and
skips the steps the run already holds (a resumed group retrains the steps after its checkpoint).
A sweep's jobs are child runs of one parent (`create_sweep_run`, `create_run(parent_run_id=...)`).

    run_id = create_run(cfg, resolve_tracking_uri(cfg.tracking.tracking_uri, os.getcwd()))
    logger = MLflowLogger(tracking_uri, run_id)      # on rank 0, in the worker
    logger.log_metrics({"train/loss": 2.3}, step=10)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Protocol, runtime_checkable

from trainer.config import JobConfig, flatten

# MLflow's server-side limits (mlflow.utils.validation); a batch over them is rejected whole.
MAX_PARAM_VAL_LENGTH = 6000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000


@runtime_checkable
class MetricsLogger(Protocol):
    """What the loop logs through. Rank 0 gets an MLflowLogger, other ranks a NullLogger."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_params(self, params: Mapping[str, object]) -> None: ...

    def set_tags(self, tags: Mapping[str, object]) -> None: ...

    def log_artifact(self, local_path: str) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """Accepts everything and does nothing: the logger of every rank but 0."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_params(self, params: Mapping[str, object]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, object]) -> None:
        pass

    def log_artifact(self, local_path: str) -> None:
        pass

    def close(self) -> None:
        pass


class MLflowLogger:
    """Logs into an existing MLflow run through MlflowClient (no global `mlflow.start_run` state).

    One `log_batch` call per `log_metrics` call: a step's metrics land together, and a crash loses
    nothing that was logged before it.

    A worker group that restarts (failure, elastic resize) resumes from its last checkpoint and
    trains again the steps logged after it, with other step times and, at another world size, a
    loss that differs in the last bits. MLflow cannot replace a logged value, so each metric skips
    the steps the run already holds when this logger first logs: one value per step, the first.
    """

    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._client = MlflowClient(tracking_uri)
        self._held: Optional[dict[str, int]] = None  # metric -> last step the run held at attach
        self._told_skip = False

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if self._held is None:
            self._held = last_logged_steps(self._client, self.run_id)
        step = int(step)
        fresh = {k: v for k, v in metrics.items() if step > self._held.get(k, -1)}
        if len(fresh) < len(metrics) and not self._told_skip:
            self._told_skip = True
            upto = max(self._held.get(k, -1) for k in metrics)
            print(f"mlflow: steps {step}..{upto} are already "
                  "in the run (logged before the restart); their retrained values are not logged "
                  "again", flush=True)
        ts = int(time.time() * 1000)
        batch = [Metric(key, _as_float(key, value), ts, step) for key, value in fresh.items()]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)

    def log_params(self, params: Mapping[str, object]) -> None:
        from mlflow.entities import Param

        batch = [Param(key, param_value(value)) for key, value in params.items()]
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)

    def set_tags(self, tags: Mapping[str, object]) -> None:
        from mlflow.entities import RunTag

        batch = [RunTag(key, str(value)) for key, value in tags.items()]
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk)

    def log_artifact(self, local_path: str) -> None:
        self._client.log_artifact(self.run_id, local_path)

    def close(self) -> None:
        """Nothing is buffered; the driver, not a worker, ends the run."""


def last_logged_steps(client, run_id: str) -> dict[str, int]:
    """{metric: largest step the run holds}, from one get_run (no history is read).

    The run's latest metrics are kept per key at the largest step; MLflow's own system-metrics
    monitor reads the step the same way (`Run.data._metric_objs`), there is no public accessor."""
    run = client.get_run(run_id)
    return {m.key: int(m.step) for m in getattr(run.data, "_metric_objs", [])}


def _as_float(key: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: value {value!r} is not a number") from None


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def param_value(value: object) -> str:
    """MLflow params are strings of at most 6000 characters; a longer value is cut and marked."""
    text = str(value)
    if len(text) <= MAX_PARAM_VAL_LENGTH:
        return text
    marker = "...[truncated]"
    return text[:MAX_PARAM_VAL_LENGTH - len(marker)] + marker


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only (rank from torch.distributed, else $RANK, else 0); flushed,
    so worker lines reach the driver's console promptly."""
    if _global_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def resolve_tracking_uri(uri: str, base_dir: str, use_env: bool = True) -> str:
    """The tracking URI every process uses, fixed at launch.

    MLFLOW_TRACKING_URI in the environment wins over the config (unless use_env is False: an
    explicit command-line URI). A relative sqlite path or a bare relative folder is made absolute
    against `base_dir` (the launch directory): MLflow resolves them against the current
    directory, and Ray workers run in another one.
    """
    uri = (os.environ.get("MLFLOW_TRACKING_URI") if use_env else None) or uri
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = uri[len(prefix):]
        if path and not path.startswith("/") and path != ":memory:":
            return prefix + str((Path(base_dir) / path).resolve())
        return uri
    if "://" not in uri and not uri.startswith("file:") and not os.path.isabs(uri):
        return str((Path(base_dir) / uri).resolve())
    return uri


def create_run(cfg: JobConfig, tracking_uri: str, parent_run_id: Optional[str] = None,
               run_name: Optional[str] = None, tags: Optional[Mapping[str, object]] = None) -> str:
    """Create the job's MLflow run (driver side) and return its id.

    Params are the flattened resolved config; tags carry the git commit, sharding strategy, world
    size and device, so runs of a sweep can be filtered and compared. `parent_run_id` nests the
    run under a sweep's parent run; `tags` are added to those.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, cfg.tracking.experiment, artifact_root(tracking_uri))
    all_tags = {**run_tags(cfg), **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name or cfg.cluster.run_name, tags=all_tags)
    MLflowLogger(tracking_uri, run.info.run_id).log_params(flatten(cfg))
    return run.info.run_id


def create_sweep_run(tracking_uri: str, experiment: str, run_name: str,
                     params: Mapping[str, object], tags: Mapping[str, object]) -> str:
    """Create a sweep's parent run (driver side): the jobs' runs name it in mlflow.parentRunId.

    `params` are what every job of the sweep shares; the swept keys differ per child and are
    left to the children. The git commit is tagged as on every run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, experiment, artifact_root(tracking_uri))
    all_tags = {k: str(v) for k, v in tags.items()}
    commit = git_commit()
    if commit:
        all_tags["mlflow.source.git.commit"] = commit
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    MLflowLogger(tracking_uri, run.info.run_id).log_params(params)
    return run.info.run_id


def artifact_root(tracking_uri: str) -> Optional[str]:
    """Artifacts of a local sqlite store go next to the database, in mlruns/.

    Left to MLflow, a new experiment's artifacts go to ./mlruns of whichever process created it,
    not next to the store. A server or a file store decides for itself (None).
    """
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and tracking_uri[len(prefix):].startswith("/"):
        return str(Path(tracking_uri[len(prefix):]).parent / "mlruns")
    return None


def _experiment_id(client, name: str, artifact_location: Optional[str]) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # another launcher created it between our get and create
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def run_tags(cfg: JobConfig) -> dict[str, str]:
    lo, hi = cfg.cluster.world_sizes
    tags = {
        "strategy": cfg.sharding.strategy,
        "world_size": str(hi) if lo == hi else f"{lo}-{hi}",
        # Ray hides GPUs from workers that did not ask for one, so "auto" means cpu there.
        "device": "cuda" if cfg.cluster.use_gpu else "cpu",
        "model": cfg.model.name,
    }
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def git_commit() -> Optional[str]:
    """HEAD of the repository this code runs from, or None (not a checkout, no commit yet)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def end_run(tracking_uri: str, run_id: str, ok: bool) -> None:
    """Mark the run FINISHED or FAILED (driver side, after the workers are done)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_terminated(run_id, "FINISHED" if ok else "FAILED")


def start_system_metrics(tracking_uri: str, run_id: str, node_id: str,
                         interval_s: float = 10.0):
    """Sample this node's CPU, memory, disk, network (and NVIDIA GPUs when nvidia-ml-py is
    installed) into the run as system/<node_id>/..., every interval_s, until `.finish()` or until
    the run is no longer RUNNING. Call once per node (local rank 0), not once per worker.

    MLflow's SystemMetricsMonitor (needs psutil) logs with its own sample counter as the step;
    resume_logging continues that counter after a restart instead of logging step 0 again."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True,
                                   node_id=node_id, tracking_uri=tracking_uri)
    monitor.start()
    return monitor


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """[(step, value)] of one metric of a run, by step."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def ui_command(tracking_uri: str) -> str:
    """The shell command that shows a local store in the MLflow UI (a server shows itself)."""
    if "://" in tracking_uri and not tracking_uri.startswith(("sqlite:", "file:")):
        return f"open {tracking_uri} in a browser"
    ours = Path(sys.executable).parent / "mlflow"
    on_path = shutil.which("mlflow")
    program = "mlflow" if on_path and Path(on_path).resolve() == ours.resolve() else str(ours)
    return f"{program} ui --backend-store-uri {tracking_uri}"
