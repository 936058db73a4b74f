"""One job's MLflow run, for cluster/train.py: created with its artifacts, ended with its summary.

    run_id = start_tracking(cfg, slot, out_dir, data)   # the run, the resolved config, the plan
    ...                                                 # the workers log into it
    finish_tracking(cfg, run_id, slot, out_dir, ok)     # summary/*, the loss curve, the end

`start_tracking` creates the run (cluster/tracking/runs.py) and logs the resolved config and the
memory plan as artifacts; `finish_tracking` logs the run's summary (Summary/*: medians and
p10-p90 after the warm-up, cluster/tracking/summary.py), the loss curve, the run's description
(its strategy and summary figures, on the Overview page of the MLflow UI), and ends the run.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import psutil
from omegaconf import OmegaConf

from cluster.address import ray_address
from cluster.config import JobConfig
from cluster.tracking.plots import plot_loss_curves
from cluster.tracking.runs import create_run, end_run, metric_history, set_note
from cluster.tracking.summary import SUMMARY, RunStats, describe, run_stats
from trainer.metrics import MLflowLogger

if TYPE_CHECKING:  # annotations only
    from cluster.job_slot import JobSlot
    from trainer.data import PreparedInfo


def start_tracking(
    cfg: JobConfig, slot: Optional[JobSlot], out_dir: str, data: Optional[PreparedInfo] = None
) -> Optional[str]:
    """The MLflow run every worker logs into: params are what runs are compared by
    (cluster/tracking/runs.py COMPARED_PARAMS, and the keys a sweep varies); the resolved config
    is an artifact, with the memory plan (both written to `out_dir` too), and the prepared data's
    digest, size and skipped records. In a sweep it is a child of the parent run, named after
    the job's swept values (and its repeat). None when tracking is off."""
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
            run_name=slot.run_name,
            tags={
                "sweep.job": slot.num,
                "sweep.dir": slot.sweep_dir,
                "sweep.config": slot.label or f"job {slot.num}",
                "sweep.repeat": slot.repeat,
            },
            params_also=slot.varied,
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
    stats = None
    try:
        stats = log_summary(uri, run_id, ranked=slot is not None)
        set_note(uri, run_id, run_note(cfg, slot, stats, ok))
    except Exception as e:  # never hide the training's own outcome behind a summary error
        print(f"mlflow: summary not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    try:
        losses = metric_history(uri, run_id, "train/loss")
        if losses:
            lo, hi = cfg.cluster.world_sizes
            world = str(hi) if lo == hi else f"{lo}-{hi}"
            label = (slot.label if slot else "") or cfg.cluster.run_name
            path = Path(out_dir) / "loss_curve.png"
            plot_loss_curves(
                {label: losses},
                str(path),
                f"train/loss: {cfg.sharding.strategy} on {world} workers",
            )
            logger = MLflowLogger(uri, run_id)
            logger.log_artifact(str(path))
            log_plot_image(uri, run_id, str(path), f"{SUMMARY}loss", losses[-1][0])
    except Exception as e:  # never hide the training's own outcome behind a plotting error
        print(
            f"mlflow: loss curve not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True
        )
    finally:
        end_run(uri, run_id, ok=ok)


def log_summary(tracking_uri: str, run_id: str, ranked: bool = False) -> Optional[RunStats]:
    """summary/* metrics and the summary/too_short tag of a run, from its own per-step history:
    one value per key, so MLflow's runs table, Compare, scatter and parallel-coordinates plots
    show the medians a strategy is chosen by. `ranked` (a sweep's job: its runs are ranked):
    warns when the run is too short or too noisy to rank strategies; a single run is ranked
    against nothing, so it only carries the tag (the report warns where it ranks). None
    (nothing logged) when the run logged no step."""
    steps = metric_history(tracking_uri, run_id, "perf/step_ms")
    if not steps:
        print("mlflow: no summary (the run logged no step)", flush=True)
        return None
    stats = run_stats(lambda key: metric_history(tracking_uri, run_id, key))
    logger = MLflowLogger(tracking_uri, run_id)
    logger.log_metrics(stats.metrics(), step=0)  # one value each: a bar in the UI, not a dot
    logger.set_tags(stats.tags())
    print(f"summary: {describe(stats)}", flush=True)
    reason = stats.too_short()
    if reason and ranked:
        print(
            f"warning: run {run_id} is too short or too noisy to rank strategies ({reason}); "
            "measure more steps (train.steps), on a machine doing nothing else, before choosing",
            file=sys.stderr,
            flush=True,
        )
    return stats


def log_plot_image(tracking_uri: str, run_id: str, png: str, key: str, step: int) -> None:
    """A PNG as an MLflow image keyed `key`: the run's Model metrics tab shows it in the
    section of its prefix."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import
    from PIL import Image  # noqa: PLC0415 -- only to log a plot (MLflow's own dependency)

    with Image.open(png) as image:
        MlflowClient(tracking_uri).log_image(run_id, image.convert("RGB"), key=key, step=step)


def run_note(cfg: JobConfig, slot: Optional[JobSlot], stats: Optional[RunStats], ok: bool) -> str:
    """The run's description in markdown: what it ran (strategy, workers, model, its sweep
    job) and what it measured (the summary figures), or why there is nothing to show."""
    lo, hi = cfg.cluster.world_sizes
    world = str(hi) if lo == hi else f"{lo}-{hi}"
    device = "GPU" if cfg.cluster.use_gpu else "CPU"
    what = (
        f"**{cfg.sharding.strategy}** on {world} {device} workers, model {cfg.model.name}, "
        f"{cfg.sharding.param_dtype} parameters, global batch {cfg.train.global_batch_size} "
        f"x {cfg.data.seq_len} tokens"
    )
    lines = [f"**{slot.label}** ({slot.name} of a sweep): " + what if slot and slot.label else what]
    lines.append("")
    if stats is None:
        lines.append("No step was logged: nothing measured." + ("" if ok else " The run failed."))
        return "\n".join(lines) + "\n"
    t, s = stats.tokens_per_s, stats.step_ms
    mib = 2**20
    lines += [
        "| tokens/s median (p10-p90) | step ms median (p10-p90) | peak MiB/rank | "
        "MiB moved/step | final loss | steps measured |",
        "|--:|--:|--:|--:|--:|--:|",
        f"| {t.median:,.0f} ({t.p10:,.0f}-{t.p90:,.0f}) | {s.median:.1f} ({s.p10:.1f}-{s.p90:.1f})"
        f" | {stats.peak_memory_bytes / mib:,.2f} | {stats.bytes_per_step / mib:,.2f} | "
        f"{stats.final_loss:.4f} | {stats.steps_measured} after {stats.steps_warmup} warm-up |",
        "",
    ]
    reason = stats.too_short()
    if reason and slot is not None:  # a sweep's job is ranked; a single run against nothing
        lines.append(f"**Too short to rank strategies**: {reason}.")
    if not ok:
        lines.append("**The run failed**: the figures are of the steps it logged.")
    lines.append(
        f"Loss and tokens/s per step: the 'At a glance' charts; the figures above: {SUMMARY}*; "
        "plot loss_curve.png; the whole config "
        "resolved_config.yaml (Artifacts)."
    )
    return "\n".join(lines) + "\n"
