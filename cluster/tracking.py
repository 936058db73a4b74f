"""MLflow on the driver: the run every worker logs into, its tags, its end, what it holds.

The driver creates the run once (`create_run`) and passes its id to the workers, where rank 0
attaches to it (trainer.metrics.MLflowLogger) and every other rank logs nowhere. A sweep's jobs
are child runs of one parent (`create_sweep_run`, `create_run(parent_run_id=...)`).

    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, os.getcwd())
    run_id = create_run(cfg, uri)
    ...                                    # the workers log train/*, perf/*, mem/*, comm/*
    end_run(uri, run_id, ok=True)

A job of cluster/train.py does the same in two steps: `start_tracking` creates the run and logs
the resolved config and the memory plan as artifacts; `finish_tracking` logs the run's summary
(summary/*: medians and p10-p90 after the warm-up, cluster/summary.py), the loss curve, and ends
the run.

MLflow is imported inside the functions that talk to it: `import mlflow` costs seconds, and the
CLI refuses a bad config, or runs with tracking off, without paying for it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

import psutil
from omegaconf import OmegaConf

from cluster.ray_launch import ray_address
from cluster.summary import RunStats, describe, run_stats
from trainer.metrics import MLflowLogger

if TYPE_CHECKING:  # annotations only: both modules import this one
    from cluster.config import JobConfig
    from cluster.sweep import JobSlot
    from trainer.data import PreparedInfo


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


def create_run(
    cfg: JobConfig,
    tracking_uri: str,
    parent_run_id: Optional[str] = None,
    run_name: Optional[str] = None,
    tags: Optional[Mapping[str, object]] = None,
) -> str:
    """Create the job's MLflow run and return its id.

    Params are the flattened resolved config; tags carry the git commit, sharding strategy, world
    size, device and where the checkpoints go, so runs of a sweep can be filtered and compared.
    `parent_run_id` nests the run under a sweep's parent run; `tags` are added to those.
    """
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    from cluster.config import flatten  # noqa: PLC0415 -- cluster.config imports this module

    client = MlflowClient(tracking_uri)
    experiment_id = _experiment_id(client, cfg.tracking.experiment, artifact_root(tracking_uri))
    all_tags = {**run_tags(cfg), **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name or cfg.cluster.run_name, tags=all_tags)
    MLflowLogger(tracking_uri, run.info.run_id).log_params(flatten(cfg))
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
        return experiment.experiment_id
    try:
        return client.create_experiment(
            name, artifact_location=artifact_location, tags=EXPERIMENT_KIND
        )
    except Exception:  # another launcher created it between our get and create
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


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


# ---- where the code came from --------------------------------------------------------------------

COMMIT_ENV = "ELASTIC_FSDP_GIT_COMMIT"
DIRTY_ENV = "ELASTIC_FSDP_GIT_DIRTY"
"""Set by `python -m cluster.submit` in the job's runtime env: `ray job submit` uploads the
working tree without .git, so the job itself cannot ask git; the submitting checkout's answer
travels with it."""


def source_tags() -> dict[str, str]:
    """MLflow tags naming the code a run ran: `mlflow.source.git.commit` (what the MLflow UI
    shows) and `git_dirty` ("true" when tracked files differed from that commit). From git when
    this code runs in a checkout, else from what `cluster.submit` passed on; when neither knows,
    `git_commit` says why instead of leaving the run without a word."""
    commit, dirty = git_commit(), git_dirty()
    if commit is None:
        commit = os.environ.get(COMMIT_ENV) or None
        dirty = {"true": True, "false": False}.get(os.environ.get(DIRTY_ENV, "").lower())
    if commit is None:
        return {"git_commit": f"unknown: not a git checkout and {COMMIT_ENV} unset"}
    tags = {"mlflow.source.git.commit": commit}
    if dirty is not None:
        tags["git_dirty"] = "true" if dirty else "false"
    return tags


def _git(*args: str) -> Optional[str]:
    """`git <args>` in the directory of this code: its stdout, or None where git fails."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> Optional[str]:
    """HEAD of the repository this code runs from, or None (not a checkout, no commit yet)."""
    commit = (_git("rev-parse", "HEAD") or "").strip()
    return commit if len(commit) == 40 else None


def git_dirty() -> Optional[bool]:
    """Whether tracked files differ from HEAD (untracked files do not count), or None."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status.strip())


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
    return f"{base}/{page}?workflowType=machine_learning"


def experiment_of(tracking_uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    return MlflowClient(tracking_uri).get_run(run_id).info.experiment_id


def ui_command(tracking_uri: str) -> str:
    """The shell command that shows a local store in the MLflow UI (a server shows itself)."""
    if "://" in tracking_uri and not tracking_uri.startswith(("sqlite:", "file:")):
        return f"open {tracking_uri} in a browser"
    ours = Path(sys.executable).parent / "mlflow"
    on_path = shutil.which("mlflow")
    program = "mlflow" if on_path and Path(on_path).resolve() == ours.resolve() else str(ours)
    return f"{program} ui --backend-store-uri {tracking_uri}"


# ---- one job's run, from cluster/train.py -------------------------------------------------------


def start_tracking(
    cfg: JobConfig, slot: Optional[JobSlot], out_dir: str, data: Optional[PreparedInfo] = None
) -> Optional[str]:
    """The MLflow run every worker logs into: params are the resolved config, which is also an
    artifact, with the memory plan (both written to `out_dir` too), and the prepared data's
    digest, size and skipped records. In a sweep it is a child of the parent run, named after
    the job's swept values. None when tracking is off."""
    if not cfg.tracking.enabled:
        return None
    uri = cfg.tracking.tracking_uri
    if slot is None:
        run_id = create_run(cfg, uri)
    else:
        run_id = create_run(
            cfg,
            uri,
            parent_run_id=slot.parent_run_id,
            run_name=slot.label or f"job {slot.num}",
            tags={"sweep.job": slot.num, "sweep.dir": slot.sweep_dir},
        )
    logger = MLflowLogger(uri, run_id)
    if data is not None:
        logger.set_tags({"data.digest": data.digest, "data.dir": data.uri})
        logger.log_metrics(data_metrics(data), step=0)
    out = Path(out_dir)
    logger.log_artifact(write_resolved_config(cfg, out / "resolved_config.yaml"))
    plan = write_memory_plan(cfg, out / "memory_plan.txt")
    if plan:
        logger.log_artifact(plan)
    print(
        f"mlflow: run {run_id} in experiment '{cfg.tracking.experiment}' at {uri}"
        + (f" (child of sweep run {slot.parent_run_id})" if slot and slot.parent_run_id else ""),
        flush=True,
    )
    return run_id


def data_metrics(data: PreparedInfo) -> dict[str, float]:
    """data/* of the prepared dataset: its size, and the records skipped by reason."""
    m = {
        "data/tokens": float(data.num_tokens),
        "data/documents": float(data.num_documents),
        "data/files": float(data.num_files),
    }
    m.update({f"data/skipped_{reason}": float(n) for reason, n in data.skipped.items()})
    return m


def write_resolved_config(cfg: JobConfig, path: Path) -> str:
    """The config exactly as the workers run it (absolute paths, the job's run name): the same
    values as the run's params, as YAML."""
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg))))
    return str(path)


def write_memory_plan(cfg: JobConfig, path: Path) -> Optional[str]:
    """trainer.plan's per-worker memory table, for the smallest world size (the most memory per
    worker) and the largest, against the memory the workers' devices have as far as this driver
    can tell (GPU workers: less the CUDA context, NCCL buffers and fragmentation margin, rows of
    the table; CPU workers: the host's whole memory); None (said on the console) where it cannot
    tell or the planner is absent."""
    try:
        from trainer.plan import plan  # noqa: PLC0415 -- torch costs seconds to import
    except ImportError as e:
        print(f"memory plan: not logged (trainer.plan unavailable: {e})", flush=True)
        return None
    memory, source = device_memory(cfg)
    if memory is None:
        print(f"memory plan: not logged ({source})", flush=True)
        return None
    sizes = sorted(set(cfg.cluster.world_sizes))
    # A local Ray puts every worker on this one node; on a cluster the planner's default applies.
    per_node = {"local_world_size": sizes[-1]} if ray_address(cfg.cluster) is None else {}
    try:
        tables = [
            plan(cfg, n, memory, **per_node, headroom=cfg.cluster.use_gpu).table() for n in sizes
        ]
    except Exception as e:  # the plan is a prediction: it must never stop the training it describes
        print(f"memory plan: not logged ({type(e).__name__}: {e})", flush=True)
        return None
    path.write_text(
        f"device memory: {memory / 2**30:.1f} GiB ({source})\n\n" + "\n\n".join(tables) + "\n"
    )
    return str(path)


def device_memory(cfg: JobConfig) -> tuple[Optional[int], str]:
    """(bytes one worker's device has, where that figure comes from) or (None, why not)."""
    if cfg.cluster.use_gpu:
        import torch  # noqa: PLC0415 -- torch costs seconds to import: GPU jobs only

        if not torch.cuda.is_available():
            return None, "GPU workers, and this driver sees no GPU to read their memory from"
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"this driver's {props.name}, taken as the workers' GPU"
    return psutil.virtual_memory().total, "CPU workers: this host's memory"


def finish_tracking(
    cfg: JobConfig, run_id: str, slot: Optional[JobSlot], out_dir: str, ok: bool
) -> None:
    """Log the run's summary and its loss curve (also of a failed run: they show what it measured
    and where it failed; the curve is written to `out_dir` too), then end the run."""
    uri = cfg.tracking.tracking_uri
    try:
        log_summary(uri, run_id)
    except Exception as e:  # never hide the training's own outcome behind a summary error
        print(f"mlflow: summary not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    try:
        losses = metric_history(uri, run_id, "train/loss")
        if losses:
            from cluster.report import plot_loss_curves  # noqa: PLC0415 -- it imports this module

            lo, hi = cfg.cluster.world_sizes
            world = str(hi) if lo == hi else f"{lo}-{hi}"
            label = (slot.label if slot else "") or cfg.cluster.run_name
            path = Path(out_dir) / "loss_curve.png"
            plot_loss_curves(
                {label: losses},
                str(path),
                f"train/loss: {cfg.sharding.strategy} on {world} workers",
            )
            MLflowLogger(uri, run_id).log_artifact(str(path))
    except Exception as e:  # never hide the training's own outcome behind a plotting error
        print(
            f"mlflow: loss curve not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True
        )
    finally:
        end_run(uri, run_id, ok=ok)


def log_summary(tracking_uri: str, run_id: str) -> Optional[RunStats]:
    """summary/* metrics and the summary/too_short tag of a run, from its own per-step history:
    one value per key, so MLflow's runs table, Compare, scatter and parallel-coordinates plots
    show the medians a strategy is chosen by. Warns when the run is too short or too noisy to
    rank strategies. None (nothing logged) when the run logged no step."""
    steps = metric_history(tracking_uri, run_id, "perf/step_ms")
    if not steps:
        print("mlflow: no summary (the run logged no step)", flush=True)
        return None
    stats = run_stats(lambda key: metric_history(tracking_uri, run_id, key))
    logger = MLflowLogger(tracking_uri, run_id)
    logger.log_metrics(stats.metrics(), step=steps[-1][0])
    logger.set_tags(stats.tags())
    print(f"summary: {describe(stats)}", flush=True)
    reason = stats.too_short()
    if reason:
        print(
            f"warning: run {run_id} is too short or too noisy to rank strategies ({reason}); "
            "measure more steps (train.steps), on a machine doing nothing else, before choosing",
            file=sys.stderr,
            flush=True,
        )
    return stats
