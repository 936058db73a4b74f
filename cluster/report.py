"""Compare the runs of a sweep: a table and plots, printed, written to a folder, logged to the
parent.

    python -m cluster.report elastic-fsdp                       # the newest sweep of an experiment
    python -m cluster.report 3f2a...c1 --out report/            # a sweep's parent run id
    python -m cluster.report elastic-fsdp --tracking-uri http://mlflow:5000

One row per child run: strategy, world size, tokens/s and step time (median, with the p10-p90
spread, over the logged steps after the warm-up: cluster/summary.py, the numbers finish_tracking
logs as summary/*), the steps measured, peak memory per rank (the engine's accounted peak,
mem/peak_total_bytes: parameters, gradients, optimizer state, gathered buffers; on GPU runs also
the device's max allocated, activations included), bytes moved per step per rank
(comm/total_bytes) and the final loss. Under the table: the fastest finished run by median
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from cluster.summary import MAX_SPREAD, MIN_MEASURED_STEPS, WARMUP_STEPS, Spread, run_stats
from cluster.tracking import resolve_tracking_uri

PLOT_SIZE_PX = (800, 500)
"""(width, height) of every PNG the report writes: 8 x 5 inches at 100 dpi."""
PLOT_DPI = 100
REPORT_FILES = (
    "report.txt",
    "report.csv",
    "loss_vs_step.png",
    "tokens_per_s_by_strategy.png",
    "memory_by_strategy.png",
)
MiB = 2**20


@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    strategy: str
    world_size: str
    tokens_per_s: float
    """Median after the warm-up, as step_ms and bytes_per_step."""
    step_ms: float
    peak_memory_bytes: float
    """The engine's accounted peak (parameters, gradients, optimizer state, gathered buffers)."""
    device_peak_bytes: float
    """torch.cuda.max_memory_allocated on GPU runs (everything, activations included); NaN on
    CPU."""
    bytes_per_step: float
    final_loss: float
    loss_curve: list = field(default_factory=list)  # [(step, loss)]
    tokens_per_s_p10: float = math.nan
    tokens_per_s_p90: float = math.nan
    step_ms_p10: float = math.nan
    step_ms_p90: float = math.nan
    steps_measured: int = 0
    too_short: str = ""
    """Why this run is too short or too noisy to rank strategies; empty when it is not."""

    @property
    def tokens(self) -> Spread:
        return Spread(self.tokens_per_s, self.tokens_per_s_p10, self.tokens_per_s_p90)


@dataclass
class Report:
    parent_run_id: Optional[str]
    rows: list
    table: str
    verdict: Verdict
    files: list  # absolute paths of everything written


# ---- which runs ------------------------------------------------------------------------------


def find_runs(client, target: str) -> tuple[Optional[object], list]:
    """(parent run or None, its child runs in job order) for a parent run id or an experiment
    name (its newest sweep; all its runs if it has none). ValueError says what was not found."""
    run = _run_or_none(client, target)
    if run is not None:
        children = child_runs(client, run)
        if not children:
            raise ValueError(
                f"run {target} has no child runs: pass a sweep's parent run id or an "
                "experiment name"
            )
        return run, children
    experiment = client.get_experiment_by_name(target)
    if experiment is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(
            f"no run id or experiment named {target!r} in {client.tracking_uri}; "
            f"experiments there: {', '.join(names) or 'none'}"
        )
    runs = client.search_runs(
        [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=5000
    )
    parent_ids = {r.data.tags.get("mlflow.parentRunId") for r in runs} - {None}
    parents = [r for r in runs if r.info.run_id in parent_ids]
    if parents:
        return parents[0], child_runs(client, parents[0])
    if not runs:
        raise ValueError(f"experiment {target!r} has no runs")
    return None, sorted(runs, key=lambda r: r.info.start_time)


def _run_or_none(client, run_id: str):
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow: seconds to import

    try:
        return client.get_run(run_id)
    except MlflowException:
        return None


def child_runs(client, parent) -> list:
    """Children of `parent`, in job order (sweep.job tag, then start time)."""
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
        max_results=5000,
    )
    return sorted(runs, key=lambda r: (int(r.data.tags.get("sweep.job", 10**9)), r.info.start_time))


# ---- what each run did -----------------------------------------------------------------------


def summarize(client, run) -> RunSummary:
    """A run's row, from its metric history with the warm-up rule of cluster/summary.py."""

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    stats = run_stats(history)
    tags = run.data.tags
    return RunSummary(
        run_id=run.info.run_id,
        name=run.info.run_name or run.info.run_id[:8],
        status=run.info.status,
        strategy=tags.get("strategy", "?"),
        world_size=tags.get("world_size", "?"),
        tokens_per_s=stats.tokens_per_s.median,
        step_ms=stats.step_ms.median,
        peak_memory_bytes=stats.peak_memory_bytes,
        device_peak_bytes=stats.device_peak_bytes,
        bytes_per_step=stats.bytes_per_step,
        final_loss=stats.final_loss,
        loss_curve=history("train/loss"),
        tokens_per_s_p10=stats.tokens_per_s.p10,
        tokens_per_s_p90=stats.tokens_per_s.p90,
        step_ms_p10=stats.step_ms.p10,
        step_ms_p90=stats.step_ms.p90,
        steps_measured=stats.steps_measured,
        too_short=stats.too_short() or "",
    )


# ---- which is fastest, and can it be told ------------------------------------------------------


@dataclass
class Verdict:
    winner: Optional[RunSummary]
    """The finished run with the highest median tokens/s; None when no run finished with one."""
    within_noise: list
    """The other finished runs whose tokens/s p10-p90 overlaps the winner's."""
    too_short: list
    """Runs too short or too noisy to rank strategies (RunSummary.too_short)."""

    def lines(self) -> list[str]:
        """What the table alone does not say: the fastest run, and how far to trust that."""
        if self.winner is None:
            return ["fastest: none (no finished run logged tokens/s)"]
        w = self.winner
        lines = [
            f"fastest: {w.name} ({w.strategy}), {w.tokens_per_s:,.0f} tokens/s median "
            f"(p10-p90 {w.tokens_per_s_p10:,.0f}-{w.tokens_per_s_p90:,.0f})"
        ]
        if self.within_noise:
            names = ", ".join(r.name for r in self.within_noise)
            ranges = "range of" if len(self.within_noise) == 1 else "ranges of"
            overlap = "overlaps" if len(self.within_noise) == 1 else "overlap"
            lines.append(
                f"warning: the ranking is within the noise: the tokens/s p10-p90 {ranges} {names} "
                f"{overlap} {w.name}'s; measure more steps (train.steps) before choosing"
            )
        for r in self.too_short:
            lines.append(
                f"warning: {r.name} is too short or too noisy to rank strategies ({r.too_short})"
            )
        return lines


def verdict(rows: list[RunSummary]) -> Verdict:
    """Rank the finished runs by median tokens/s (higher is faster)."""
    ranked = sorted(
        (r for r in rows if r.status == "FINISHED" and not math.isnan(r.tokens_per_s)),
        key=lambda r: r.tokens_per_s,
        reverse=True,
    )
    if not ranked:
        return Verdict(None, [], [r for r in rows if r.too_short])
    winner = ranked[0]
    noise = [r for r in ranked[1:] if r.tokens.overlaps(winner.tokens)]
    return Verdict(winner, noise, [r for r in rows if r.too_short])


def winner_tags(v: Verdict) -> dict[str, str]:
    """The parent run's sweep/* tags: which child won, and whether that can be trusted."""
    if v.winner is None:
        return {"sweep/winner": "none"}
    return {
        "sweep/winner": v.winner.name,
        "sweep/winner_strategy": v.winner.strategy,
        "sweep/winner_run_id": v.winner.run_id,
        "sweep/within_noise": str(bool(v.within_noise)).lower(),
        "sweep/too_short": str(bool(v.too_short)).lower(),
    }


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


# ---- the plots -------------------------------------------------------------------------------


def _figure():
    import matplotlib  # noqa: PLC0415 -- matplotlib costs a second to import: only to plot

    matplotlib.use("Agg")  # no display on a cluster head or in CI
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- after matplotlib.use("Agg")

    return plt, plt.figure(
        figsize=(PLOT_SIZE_PX[0] / PLOT_DPI, PLOT_SIZE_PX[1] / PLOT_DPI), dpi=PLOT_DPI
    )


def plot_loss_curves(curves: dict[str, list[tuple[int, float]]], path: str, title: str) -> str:
    """One line per run: train/loss against the global optimizer step."""
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 -- matplotlib: only to plot

    plt, fig = _figure()
    ax = fig.add_subplot()
    # Strategies in fp32 give the same losses: keep each line visible.
    styles = ("-", "--", "-.", ":")
    for i, (label, points) in enumerate(curves.items()):
        if points:
            ax.plot(
                [s for s, _ in points],
                [v for _, v in points],
                styles[i % len(styles)],
                label=label,
                linewidth=1.8,
                marker="o" if len(points) <= 30 else None,
                markersize=3,
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train/loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)  # no bbox_inches="tight": every plot keeps PLOT_SIZE_PX
    plt.close(fig)
    return path


def plot_bars(
    labels: list[str],
    values: list[float],
    ylabel: str,
    title: str,
    path: str,
    ranges: Optional[list[tuple[float, float]]] = None,
) -> str:
    """One bar per run; `ranges` [(p10, p90)] draws them as error bars around each value."""
    plt, fig = _figure()
    ax = fig.add_subplot()
    heights = [0.0 if math.isnan(v) else v for v in values]
    yerr = None
    if ranges is not None:
        below = [_gap(v - lo) for v, (lo, _) in zip(values, ranges)]
        above = [_gap(hi - v) for v, (_, hi) in zip(values, ranges)]
        yerr = [below, above]
    bars = ax.bar(
        range(len(labels)),
        heights,
        yerr=yerr,
        capsize=6,
        color=[f"C{i}" for i in range(len(labels))],
    )
    # Inside the bar when error bars stand on its top.
    label_type = "edge" if ranges is None else "center"
    ax.bar_label(
        bars, labels=[_num(v, ",.1f") for v in values], fontsize="small", label_type=label_type
    )
    ax.set_xticks(range(len(labels)), labels, fontsize="small")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def _gap(x: float) -> float:
    return 0.0 if math.isnan(x) else max(0.0, x)


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
