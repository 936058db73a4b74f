"""Compare the runs of a sweep: a table and plots, printed, written to a folder, logged to the
parent.

    python -m cluster.report elastic-fsdp                       # the newest sweep of an experiment
    python -m cluster.report 3f2a...c1 --out report/            # a sweep's parent run id
    python -m cluster.report elastic-fsdp --tracking-uri http://mlflow:5000

One row per child run: strategy, world size, tokens/s and step time (median, with the p10-p90
spread, over the logged steps after the warm-up: cluster/tracking/summary.py, the numbers
finish_tracking logs as summary/*), the steps measured, peak memory per rank (the engine's
accounted peak, mem/peak_total_bytes: parameters, gradients, optimizer state, gathered buffers;
on GPU runs also the device's max allocated, activations included), bytes moved per step per
rank (comm/total_bytes) and the final loss. Under the table: the fastest finished run by median
tokens/s, and a warning when its p10-p90 overlaps another run's (the ranking is within the noise)
or when a run is too short or too noisy to rank. The parent run is tagged with the fastest
(sweep/winner).
Plots: loss against step for every run, tokens/s by strategy (p10-p90 error bars), memory by
strategy. An experiment without sweeps is reported run by run (there is then no parent to log to).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cluster.tracking.compare import RunSummary, Verdict, find_runs, summarize, verdict, winner_tags
from cluster.tracking.plots import plot_bars, plot_loss_curves
from cluster.tracking.runs import resolve_tracking_uri
from cluster.tracking.summary import MAX_SPREAD, MIN_MEASURED_STEPS, WARMUP_STEPS

REPORT_FILES = (
    "report.txt",
    "report.csv",
    "loss_vs_step.png",
    "tokens_per_s_by_strategy.png",
    "memory_by_strategy.png",
)
MiB = 2**20


@dataclass
class Report:
    parent_run_id: Optional[str]
    rows: list
    table: str
    verdict: Verdict
    files: list  # absolute paths of everything written


# ---- the table -------------------------------------------------------------------------------

COLUMNS = (
    "run",
    "strategy",
    "world",
    "tokens/s (p10-p90)",
    "step ms (p10-p90)",
    "steps",
    "peak mem MiB",
    "MiB moved/step",
    "final loss",
    "status",
)
DEVICE_COLUMN = "device peak MiB"


def format_table(rows: list[RunSummary]) -> str:
    """Aligned plain text; a device-memory column is added when some run measured it (GPU).
    A run too short or too noisy to rank strategies has a `*` after its steps."""
    with_device = any(not math.isnan(r.device_peak_bytes) for r in rows)
    head = COLUMNS[:7] + ((DEVICE_COLUMN,) if with_device else ()) + COLUMNS[7:]
    cells = [head]
    for r in rows:
        device = (_num(r.device_peak_bytes / MiB, ".1f"),) if with_device else ()
        cells.append(
            (
                r.name,
                r.strategy,
                r.world_size,
                _spread(r.tokens_per_s, r.tokens_per_s_p10, r.tokens_per_s_p90, ",.0f"),
                _spread(r.step_ms, r.step_ms_p10, r.step_ms_p90, ".1f"),
                f"{r.steps_measured}{'*' if r.too_short else ''}",
                _num(r.peak_memory_bytes / MiB, ".2f"),
                *device,
                _num(r.bytes_per_step / MiB, ".2f"),
                _num(r.final_loss, ".4f"),
                r.status,
            )
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _num(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _spread(median: float, p10: float, p90: float, spec: str) -> str:
    """'1,136 (1,050-1,200)'; '-' when nothing was measured."""
    if math.isnan(median):
        return "-"
    if math.isnan(p10) or math.isnan(p90):
        return format(median, spec)
    return f"{format(median, spec)} ({format(p10, spec)}-{format(p90, spec)})"


def table_notes(rows: list[RunSummary]) -> list[str]:
    """How the table's numbers were taken, and what `*` means."""
    notes = [
        f"medians and p10-p90 over the logged steps after the first {WARMUP_STEPS} (warm-up; "
        "at most half of a run's logged steps)"
    ]
    if any(r.too_short for r in rows):
        notes.append(
            f"* too short or too noisy to rank strategies (fewer than {MIN_MEASURED_STEPS} "
            f"steps measured, or a step-time p10-p90 wider than {MAX_SPREAD:.0%} of its median)"
        )
    return notes


CSV_FIELDS = (
    "run_id",
    "name",
    "strategy",
    "world_size",
    "tokens_per_s",
    "tokens_per_s_p10",
    "tokens_per_s_p90",
    "step_ms",
    "step_ms_p10",
    "step_ms_p90",
    "steps_measured",
    "too_short",
    "peak_memory_bytes",
    "device_peak_bytes",
    "bytes_per_step",
    "final_loss",
    "status",
)


def write_csv(rows: list[RunSummary], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            w.writerow([getattr(r, f) for f in CSV_FIELDS])


# ---- the plots (cluster/tracking/plots.py draws them) -------------------------------------------


def bar_labels(rows: list[RunSummary]) -> list[str]:
    """The strategy when it tells the runs apart, else the run name under it."""
    strategies = [r.strategy for r in rows]
    if len(set(strategies)) == len(strategies):
        return strategies
    return [f"{r.strategy}\n{r.name}" for r in rows]


def write_plots(rows: list[RunSummary], out: Path) -> list[str]:
    labels = bar_labels(rows)
    return [
        plot_loss_curves(
            {r.name: r.loss_curve for r in rows}, str(out / "loss_vs_step.png"), "train/loss by run"
        ),
        plot_bars(
            labels,
            [r.tokens_per_s for r in rows],
            "tokens/s (median, p10-p90 bars)",
            "throughput by strategy",
            str(out / "tokens_per_s_by_strategy.png"),
            ranges=[(r.tokens_per_s_p10, r.tokens_per_s_p90) for r in rows],
        ),
        plot_bars(
            labels,
            [r.peak_memory_bytes / MiB for r in rows],
            "peak memory per rank, MiB",
            "memory by strategy (mem/peak_total_bytes)",
            str(out / "memory_by_strategy.png"),
        ),
    ]


# ---- all of it -------------------------------------------------------------------------------


def write_report(tracking_uri: str, target: str, out_dir: str) -> Report:
    """Print the table and the verdict, write them, the CSV and the plots to out_dir, log them to
    the parent run and tag it with the fastest run (sweep/winner)."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 -- mlflow costs seconds to import

    client = MlflowClient(tracking_uri)
    parent, children = find_runs(client, target)
    rows = [summarize(client, run) for run in children]
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    decision = verdict(rows)
    below = "\n".join(table_notes(rows) + [""] + decision.lines())
    head = (
        f"sweep {parent.info.run_name!r} (parent run {parent.info.run_id})"
        if parent
        else f"experiment {target!r}"
    )
    (out / "report.txt").write_text(f"{head}\n\n{table}\n\n{below}\n")
    write_csv(rows, out / "report.csv")
    files = [str(out / "report.txt"), str(out / "report.csv"), *write_plots(rows, out)]
    print(f"{head}, {len(rows)} runs, tracking URI {tracking_uri}\n\n{table}\n\n{below}\n")
    if parent is not None:
        for path in files:
            client.log_artifact(parent.info.run_id, path, artifact_path="report")
        for key, value in winner_tags(decision).items():
            client.set_tag(parent.info.run_id, key, value)
        if decision.winner is not None:
            client.log_metric(
                parent.info.run_id, "sweep/winner_tokens_per_s_median", decision.winner.tokens_per_s
            )
    print(
        f"report: {out} ({', '.join(Path(f).name for f in files)})"
        + (f", also logged to run {parent.info.run_id} under report/" if parent else ""),
        flush=True,
    )
    return Report(parent.info.run_id if parent else None, rows, table, decision, files)


def tracking_uri_for(arg: Optional[str]) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else ./mlflow.db; a missing sqlite file is an
    error (MLflow would create an empty store and report that nothing is there)."""
    uri = resolve_tracking_uri(arg or "sqlite:///mlflow.db", os.getcwd(), use_env=not arg)
    path = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None
    if path and path != ":memory:" and not Path(path).exists():
        raise FileNotFoundError(
            f"no MLflow store at {path}; valid: the sqlite file the runs were "
            "logged to (--tracking-uri sqlite:////abs/mlflow.db) or a "
            "server URI"
        )
    return uri


def main(argv: Optional[list[str]] = None) -> int:
    first_paragraph = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog="python -m cluster.report", description=first_paragraph)
    parser.add_argument(
        "target",
        metavar="EXPERIMENT_OR_PARENT_RUN",
        help="an experiment name (its newest sweep) or a sweep's parent run id",
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    parser.add_argument(
        "--out", default="report", help="folder for the table and plots (default: ./report)"
    )
    args = parser.parse_args(argv)
    try:
        write_report(tracking_uri_for(args.tracking_uri), args.target, args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
