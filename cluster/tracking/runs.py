"""MLflow on the driver: the run every worker logs into, its tags, its end, what it holds.

The driver creates the run once (`create_run`) and passes its id to the workers, where rank 0
attaches to it (trainer.metrics.MLflowLogger) and every other rank logs nowhere. A sweep's jobs
are child runs of one parent (`create_sweep_run`, `create_run(parent_run_id=...)`).

    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, os.getcwd())
    run_id = create_run(cfg, uri)
    ...                                    # the workers log train/*, perf/*, mem/*, comm/*
    end_run(uri, run_id, ok=True)

A job of cluster/train.py does this through cluster/tracking/job.py (the run with its artifacts,
then its summary and loss curve).

MLflow is imported inside the functions that talk to it: `import mlflow` costs seconds, and the
CLI refuses a bad config, or runs with tracking off, without paying for it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional

from cluster.config import ClusterConfig, JobConfig, flatten
from cluster.tracking.source import source_tags
from trainer.metrics import MLflowLogger
from trainer.shell import program


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
        path = uri[len(prefix) :]
        if path and not path.startswith("/") and path != ":memory:":
            return prefix + str((Path(base_dir) / path).resolve())
        return uri
    if "://" not in uri and not uri.startswith("file:") and not os.path.isabs(uri):
        return str((Path(base_dir) / uri).resolve())
    return uri


NOTE_TAG = "mlflow.note.content"
"""A run's description: markdown, shown on top of the run's Overview page in the MLflow UI."""

COMPARED_PARAMS = (
    "sharding.strategy",
    "sharding.param_dtype",
    "sharding.reduce_dtype",
    "sharding.activation_checkpointing",
    "sharding.offload",
    "sharding.master_dtype",
    "optim.state_dtype",
    "train.compile",
    "train.float8",
    "model.name",
    "model.hf_path",
    "model.n_layers",
    "model.dim",
    "cluster.num_workers",
    "cluster.min_workers",
    "cluster.max_workers",
    "cluster.use_gpu",
    "train.steps",
    "train.global_batch_size",
    "train.micro_batches",
    "data.source",
    "data.kind",
    "data.train_on",
    "data.seq_len",
    "data.prepared_dir",
    "optim.lr",
    "optim.warmup_steps",
    "optim.weight_decay",
)
"""A run's MLflow params: what decides its speed, memory and loss, the columns Compare lines up
(strategy, mixed precision, the memory and speed levers, the model, the workers, the batch, the
data and its window, the learning rate). The whole resolved config stays the artifact
resolved_config.yaml; the keys a sweep varies are added to these (`compared_params`)."""


def compared_params(cfg: JobConfig, also: Iterable[str] = ()) -> dict[str, object]:
    """COMPARED_PARAMS of `cfg` and the keys `also` (a sweep's varied keys), in that order;
    unset values (None) and data.train_on of plain text (no turns to mask) are left out."""
    flat = flatten(cfg)
    keys = list(COMPARED_PARAMS) + [k for k in also if k not in COMPARED_PARAMS]
    skip = {"data.train_on"} if cfg.data.kind == "text" else set()
    return {k: flat[k] for k in keys if k in flat and flat[k] is not None and k not in skip}


def set_note(tracking_uri: str, run_id: str, markdown: str) -> None:
    """The run's description (NOTE_TAG)."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    MlflowClient(tracking_uri).set_tag(run_id, NOTE_TAG, markdown)


def create_run(
    cfg: JobConfig,
    tracking_uri: str,
    parent_run_id: Optional[str] = None,
    run_name: Optional[str] = None,
    tags: Optional[Mapping[str, object]] = None,
    params_also: Iterable[str] = (),
) -> str:
    """Create the job's MLflow run and return its id.

    Params are `compared_params` (with `params_also`, the keys its sweep varies); tags carry the
    git commit, sharding strategy, world size, device and where the checkpoints go, so runs of a
    sweep can be filtered and compared. `parent_run_id` nests the run under a sweep's parent run;
    `tags` are added to those.
    """
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, cfg.tracking.experiment, artifact_root(tracking_uri))
    all_tags = {**run_tags(cfg), **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name or display_name(cfg), tags=all_tags)
    MLflowLogger(tracking_uri, run.info.run_id).log_params(compared_params(cfg, params_also))
    return run.info.run_id


def create_sweep_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    params: Mapping[str, object],
    tags: Mapping[str, object],
) -> str:
    """Create a sweep's parent run: the jobs' runs name it in mlflow.parentRunId.

    `params` are what every job of the sweep shares; the swept keys differ per child and are
    left to the children. The source (git commit, dirty flag) is tagged as on every run."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, experiment, artifact_root(tracking_uri))
    all_tags = {**source_tags(), **{k: str(v) for k, v in tags.items()}}
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    MLflowLogger(tracking_uri, run.info.run_id).log_params(params)
    return run.info.run_id


def artifact_root(tracking_uri: str) -> Optional[str]:
    """Artifacts of a local sqlite store go next to the database, in mlruns/.

    Left to MLflow, a new experiment's artifacts go to ./mlruns of whichever process created it,
    not next to the store. A server or a file store decides for itself (None).
    """
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and tracking_uri[len(prefix) :].startswith("/"):
        return str(Path(tracking_uri[len(prefix) :]).parent / "mlruns")
    return None


def _experiment_id(client, name: str, artifact_location: Optional[str]) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if VIEW_TAG not in experiment.tags:  # an experiment of an older launcher
            client.set_experiment_tag(experiment.experiment_id, VIEW_TAG, saved_view())
        return experiment.experiment_id
    try:
        return client.create_experiment(
            name,
            artifact_location=artifact_location,
            tags={**EXPERIMENT_KIND, VIEW_TAG: saved_view()},
        )
    except Exception:  # another launcher created it between our get and create
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def display_name(cfg: JobConfig) -> str:
    """A run's name in MLflow's runs list, what tells launches apart first (the column shows
    about 20 characters): "FULL_SHARD x2 · tiny cpu", then the run's own name when the user
    chose one ("... · qwen-sft"). cluster.run_name stays the run folder's name (the
    checkpoint_root tag); a sweep's jobs are named by the values they sweep instead."""
    lo, hi = cfg.cluster.world_sizes
    world = str(hi) if lo == hi else f"{lo}-{hi}"
    model = Path(cfg.model.hf_path).name if cfg.model.hf_path else cfg.model.name
    name = f"{cfg.sharding.strategy} x{world} · {model} {'cuda' if cfg.cluster.use_gpu else 'cpu'}"
    if cfg.cluster.run_name != ClusterConfig().run_name:
        name += f" · {cfg.cluster.run_name}"
    return name


VIEW_KEY = "elastic-fsdp"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
"""MLflow 3's saved view of an experiment's runs list (its "Views" menu; opened by the
`viewStateShareKey` the printed experiment URL carries): the list shows no metric by default,
this view shows each run's final loss, speed, memory, strategy and world size."""
VIEW_COLUMNS = (
    "metrics.`Summary/final_loss`",
    "metrics.`Summary/tokens_per_s_median`",
    "metrics.`Summary/step_ms_median`",
    "metrics.`Summary/peak_memory_gib`",
    "params.`sharding.strategy`",
    "tags.`world_size`",
)


def saved_view() -> str:
    """The VIEW_TAG value: MLflow's shared view state (name, times, the state as a JSON string)."""
    now = int(time.time() * 1000)
    state = {"selectedColumns": list(VIEW_COLUMNS), "orderByKey": "attributes.start_time"}
    state["orderByAsc"] = False
    return json.dumps(
        {"name": "Loss and speed", "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
    )


def run_tags(cfg: JobConfig) -> dict[str, str]:
    lo, hi = cfg.cluster.world_sizes
    tags = {
        "strategy": str(cfg.sharding.strategy),
        "world_size": str(hi) if lo == hi else f"{lo}-{hi}",
        # Ray hides GPUs from workers that did not ask for one, so "auto" means cpu there.
        "device": "cuda" if cfg.cluster.use_gpu else "cpu",
        "model": cfg.model.name,
        "checkpoint_root": cfg.checkpoint_root,
    }
    return {**tags, **source_tags()}


def end_run(tracking_uri: str, run_id: str, ok: bool, status: Optional[str] = None) -> None:
    """Mark the run FINISHED or FAILED (or `status`, e.g. KILLED) once the workers are done."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    MlflowClient(tracking_uri).set_terminated(run_id, status or ("FINISHED" if ok else "FAILED"))


def end_abandoned_run(tracking_uri: str, run_id: str, by_launch: str) -> bool:
    """A launch whose driver died left its MLflow run RUNNING: end it as KILLED (tagged with the
    launch that found it), so the UI never shows a run running forever. True if it was ended."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    client = MlflowClient(tracking_uri)
    try:
        if client.get_run(run_id).info.status != "RUNNING":
            return False
        client.set_tag(run_id, "ended_by_launch", by_launch)
        client.set_terminated(run_id, "KILLED")
    except MlflowException:  # another tracking server, or a deleted run: nothing to end here
        return False
    return True


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """[(step, value)] of one metric of a run, by step."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    history = MlflowClient(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""Tag of the experiments this project creates: MLflow 3's UI opens them as model training
(runs, charts, compare), not as a GenAI app (traces), where it reads the tag."""


def ui_url(tracking_uri: str, experiment_id: str, run_id: Optional[str] = None) -> str:
    """The MLflow UI page of a run (or of an experiment's runs) in the "Model training" mode:
    MLflow 3 opens in its GenAI mode, whose experiment page has no runs table, unless the URL
    or the user's last choice says otherwise. A local store is served by `ui_command`'s server
    on its default address."""
    remote = "://" in tracking_uri and not tracking_uri.startswith(("sqlite:", "file:"))
    base = tracking_uri.rstrip("/") if remote else "http://127.0.0.1:5000"
    page = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    view = "" if run_id else f"&viewStateShareKey={VIEW_KEY}"  # the runs list with its columns
    return f"{base}/{page}?workflowType=machine_learning{view}"


def experiment_of(tracking_uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    return MlflowClient(tracking_uri).get_run(run_id).info.experiment_id


def ui_command(tracking_uri: str) -> str:
    """The shell command that shows a local store in the MLflow UI (a server shows itself)."""
    if "://" in tracking_uri and not tracking_uri.startswith(("sqlite:", "file:")):
        return f"open {tracking_uri} in a browser"
    return f"{program('mlflow')} ui --backend-store-uri {tracking_uri}"
