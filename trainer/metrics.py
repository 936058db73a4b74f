"""Worker-side metrics: rank 0 logs into the driver's MLflow run, every other rank logs nowhere.

The driver creates the run (cluster/tracking/) and passes its id to the workers; rank 0 attaches
to it with `MLflowLogger` and every other rank gets a `NullLogger`, so the loop never asks
"am I rank 0?" before logging. Workers never start a run of their own: a restarted worker group
(elastic resize, failure) keeps logging into the same run, keyed by the global optimizer step, and
skips the steps the run already holds (a resumed group retrains the steps after its checkpoint).

    logger = MLflowLogger(tracking_uri, run_id)      # on rank 0, in the worker
    logger.log_metrics({"train/loss": 2.3}, step=10)

MLflow is imported inside the functions that use it: `import mlflow` costs seconds, and the
ranks that never log (all but rank 0) never pay for it.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Mapping, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from trainer.device import peak_flops

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

    def log_text(self, text: str, artifact_file: str) -> None: ...

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

    def log_text(self, text: str, artifact_file: str) -> None:
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
        from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._client = MlflowClient(tracking_uri)
        self._held: Optional[dict[str, int]] = None  # metric -> last step the run held at attach
        self._told_skip = False

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415 -- mlflow costs seconds to import

        if self._held is None:
            self._held = last_logged_steps(self._client, self.run_id)
        step = int(step)
        fresh = {k: v for k, v in metrics.items() if step > self._held.get(k, -1)}
        if len(fresh) < len(metrics) and not self._told_skip:
            self._told_skip = True
            upto = max(self._held.get(k, -1) for k in metrics)
            print(
                f"mlflow: steps {step}..{upto} are already "
                "in the run (logged before the restart); their retrained values are not logged "
                "again",
                flush=True,
            )
        ts = int(time.time() * 1000)
        batch = [Metric(key, _as_float(key, value), ts, step) for key, value in fresh.items()]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)

    def log_params(self, params: Mapping[str, object]) -> None:
        from mlflow.entities import Param  # noqa: PLC0415 -- mlflow costs seconds to import

        batch = [Param(key, param_value(value)) for key, value in params.items()]
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)

    def set_tags(self, tags: Mapping[str, object]) -> None:
        from mlflow.entities import RunTag  # noqa: PLC0415 -- mlflow costs seconds to import

        batch = [RunTag(key, str(value)) for key, value in tags.items()]
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk)

    def log_artifact(self, local_path: str) -> None:
        self._client.log_artifact(self.run_id, local_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        """`text` as the run's artifact `artifact_file` (e.g. samples/step_100.txt), from
        memory: no file of ours to write or clean up. A restarted group that logs the same
        step again replaces the file (artifacts, unlike metrics, can be overwritten)."""
        self._client.log_text(self.run_id, text, artifact_file)

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
        yield items[i : i + size]


def param_value(value: object) -> str:
    """MLflow params are strings of at most 6000 characters; a longer value is cut and marked."""
    text = str(value)
    if len(text) <= MAX_PARAM_VAL_LENGTH:
        return text
    marker = "...[truncated]"
    return text[: MAX_PARAM_VAL_LENGTH - len(marker)] + marker


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only (rank from torch.distributed, else $RANK, else 0); flushed,
    so worker lines reach the driver's console promptly."""
    if _global_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def start_system_metrics(tracking_uri: str, run_id: str, node_id: str, interval_s: float = 10.0):
    """Sample this node's CPU, memory, disk, network (and NVIDIA GPUs when nvidia-ml-py is
    installed) into the run as system/<node_id>/..., every interval_s, until `.finish()` or until
    the run is no longer RUNNING. Call once per node (local rank 0), not once per worker.

    MLflow's SystemMetricsMonitor (needs psutil) logs with its own sample counter as the step;
    resume_logging continues that counter after a restart instead of logging step 0 again. Its
    first CPU figure would be psutil's 0.0 (psutil 7 measures CPU % between two calls in the
    same thread): the sampling thread takes its reference first and samples an interval later."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # noqa: PLC0415 -- mlflow costs seconds to import

    class Monitor(SystemMetricsMonitor):
        def monitor(self):
            import psutil  # noqa: PLC0415 -- MLflow's dependency for system metrics

            psutil.cpu_percent()  # this thread's reference for the first sample
            if not self._shutdown_event.wait(self.sampling_interval):
                super().monitor()

    monitor = Monitor(
        run_id,
        sampling_interval=interval_s,
        resume_logging=True,
        node_id=node_id,
        tracking_uri=tracking_uri,
    )
    monitor.start()
    return monitor


class NodeMetrics:
    """A node's MLflow system metrics with enough samples to mean something, or none.

    MLflow's monitor samples every `interval_s` from its start. It starts at the first logged
    step after step 1, when the run's remaining time is known from its step time: the interval
    is that time over TARGET_SAMPLES, within [MIN_INTERVAL_S, MAX_INTERVAL_S] (a 2-minute run
    samples every 4 s, a day-long one every 30 s), and where fewer than MIN_SAMPLES would fit,
    none are taken. `interval_s`, when
    set (tracking.system_metrics_interval_s), is used as given; 0 turns them off. The decision is
    tagged on the run (`system_metrics`) by the node of global rank 0."""

    TARGET_SAMPLES = 30
    MIN_SAMPLES = 10
    MIN_INTERVAL_S = 1.0
    MAX_INTERVAL_S = 30.0

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        node_id: str,
        total_steps: int,
        interval_s: Optional[float] = None,
        tag: bool = False,
        start: Callable[..., object] = start_system_metrics,
    ):
        self.tracking_uri, self.run_id, self.node_id = tracking_uri, run_id, node_id
        self.total_steps, self.interval_s, self.tag = total_steps, interval_s, tag
        self._start = start
        self.monitor: Optional[object] = None
        self.decided: Optional[str] = None  # what was chosen, once it was

    def interval(self, step: int, step_ms: float) -> Optional[float]:
        """Seconds between samples from step `step` on, or None for no system metrics."""
        if self.interval_s is not None:
            return self.interval_s if self.interval_s > 0 else None
        remaining_s = max(self.total_steps - step, 0) * step_ms / 1000.0
        interval = min(max(remaining_s / self.TARGET_SAMPLES, self.MIN_INTERVAL_S),
                       self.MAX_INTERVAL_S)  # fmt: skip
        return interval if remaining_s / interval >= self.MIN_SAMPLES else None

    def on_step(self, step: int, metrics: dict) -> None:
        """WorkerContext.after_step (logged steps): decides once, at the first one after step 1
        (step 1 carries start-up; an explicit interval starts at once)."""
        if self.decided is not None or (self.interval_s is None and step < 2):
            return
        step_ms = float(metrics.get("perf/step_ms", 0.0))
        interval = self.interval(step, step_ms)
        if interval is None:
            left = (self.total_steps - step) * step_ms / 1000.0
            self.decided = (
                "off: tracking.system_metrics_interval_s=0"
                if self.interval_s is not None
                else f"off: about {left:.0f} s of training left at step {step}, "
                f"fewer than {self.MIN_SAMPLES} samples of {self.MIN_INTERVAL_S:g} s"
            )
        else:
            self.monitor = self._start(
                self.tracking_uri, self.run_id, self.node_id, interval_s=interval
            )
            self.decided = f"every {interval:.1f} s from step {step}"
        if self.tag:
            from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow: seconds to import

            MlflowClient(self.tracking_uri).set_tag(self.run_id, "system_metrics", self.decided)

    def finish(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None


def step_metrics(
    *,
    loss: float,
    lr: float,
    grad_norm: float,
    seconds: float,
    tokens: int,
    flops_per_token: float,
    world_size: int,
    device: torch.device,
    param_dtype: str,
) -> dict[str, float]:
    """The loop's figures of one step: train/* and perf/* (tokens/s, step time, TFLOPs per worker,
    MFU where the device's peak is known) and the world size. The engine adds its comm/* and
    mem/* (FSDPModel.metrics); the loop the measured peak (trainer/loop.py memory_metrics)."""
    tokens_per_s = tokens / seconds
    m = {
        "train/loss": loss,
        "train/lr": lr,
        "train/grad_norm": grad_norm,
        "perf/tokens_per_s": tokens_per_s,
        "perf/step_ms": seconds * 1000.0,
        "perf/tflops_per_worker": flops_per_token * tokens_per_s / world_size / 1e12,
        "elastic/world_size": float(world_size),
    }
    peak = peak_flops(device, param_dtype)
    if peak:
        m["perf/mfu"] = m["perf/tflops_per_worker"] * 1e12 / peak
    return m
