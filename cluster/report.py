"""Compare the runs of a sweep: a table, a verdict and plots, printed, written to a folder, and
logged to the parent run (its description holds the table: MLflow's Overview page answers).

    python -m cluster.report elastic-fsdp                       # the newest sweep of an experiment
    python -m cluster.report 3f2a...c1 --out report/            # a sweep's parent run id
    python -m cluster.report elastic-fsdp --tracking-uri http://mlflow:5000

One row per child run: strategy, world size, tokens/s and step time (median, with the p10-p90
spread, over the logged steps after the warm-up: cluster/tracking/summary.py, the numbers
finish_tracking logs as Summary/*), the steps measured, peak memory per rank (the engine's
accounted peak, mem/peak_total_bytes: parameters, gradients, optimizer state, gathered buffers;
on GPU runs also the device's max allocated, activations included), bytes moved per step per
rank (comm/total_bytes) and the final loss.

Under the table, the verdict (cluster/tracking/compare.py): the fastest configuration only when
the numbers can tell it (every run long and steady enough, and its throughput range clear of
every other's: p10-p90 of one run, the spread of the medians of repeats), else
"no ranking: <why>"; and the one that needs least memory. Only a told fastest is tagged
`sweep/winner` on the parent.

Logged to the parent: the description (`mlflow.note.content`: the verdict and the table in
markdown, shown on the run's Overview page), report/report.txt and report/report.csv, and the
plots at the run's root (the Artifacts tab lists them first) and as images keyed Summary/* (the
run's Model metrics tab shows them first). Plots: loss against step for every run, tokens/s by
run (p10-p90 error bars), memory by run; too-short runs are hatched. An experiment without sweeps
is reported run by run (there is then no parent to log to).
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

from cluster.tracking.compare import (
    WINNER_TAGS,
    RunSummary,
    Verdict,
    find_runs,
    summarize,
    verdict,
    verdict_tags,
)
from cluster.tracking.plots import plot_bars, plot_loss_curves
from cluster.tracking.runs import NOTE_TAG, resolve_tracking_uri
from cluster.tracking.summary import MAX_SPREAD, MIN_MEASURED_STEPS, SUMMARY, WARMUP_STEPS

PLOTS = ("tokens_per_s_by_strategy.png", "memory_by_strategy.png", "loss_vs_step.png")
REPORT_FILES = ("report.txt", "report.csv", *PLOTS)
"""What the report writes to its folder."""
REPORT_ARTIFACTS = ("report/report.txt", "report/report.csv", *PLOTS)
"""Where they go in the parent run: the plots at its root, where the Artifacts tab lists them
first; the table's files under report/."""
IMAGE_KEYS = {
    "tokens_per_s_by_strategy.png": f"{SUMMARY}throughput",
    "memory_by_strategy.png": f"{SUMMARY}memory",
    "loss_vs_step.png": f"{SUMMARY}loss",
}
"""The plots as MLflow images too: the parent's Model metrics tab shows them, in its first
section (Summary)."""
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
    "too_short_reason",
    "peak_memory_bytes",
    "device_peak_bytes",
    "bytes_per_step",
    "final_loss",
    "status",
    "config",
)


def write_csv(rows: list[RunSummary], path: Path) -> None:
    """One line per run; too_short is a boolean (True/False, as pandas reads it back), the
    reason beside it."""
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
    """The PLOTS, in that order; a too-short run is hatched in the bars and named so in the
    loss curves' legend."""
    labels = bar_labels(rows)
    short = [r.too_short for r in rows]
    return [
        plot_bars(
            labels,
            [r.tokens_per_s for r in rows],
            "tokens/s (median, p10-p90 bars)",
            "throughput by strategy",
            str(out / "tokens_per_s_by_strategy.png"),
            ranges=[(r.tokens_per_s_p10, r.tokens_per_s_p90) for r in rows],
            marked=short,
        ),
        plot_bars(
            labels,
            [r.peak_memory_bytes / MiB for r in rows],
            "peak memory per rank, MiB",
            "memory by strategy (mem/peak_total_bytes)",
            str(out / "memory_by_strategy.png"),
            marked=short,
        ),
        plot_loss_curves(
            {r.name + (" (too short)" if r.too_short else ""): r.loss_curve for r in rows},
            str(out / "loss_vs_step.png"),
            "train/loss by run",
        ),
    ]


# ---- the parent's description: what its Overview page shows ------------------------------------

MARKDOWN_COLUMNS = (
    "run",
    "strategy",
    "world",
    "tokens/s median (p10-p90)",
    "step ms median",
    "peak MiB/rank",
    "MiB moved/step",
    "final loss",
    "status",
)


def markdown_note(head: str, rows: list[RunSummary], decision: Verdict, notes: list[str]) -> str:
    """The verdict in one bold line (the Overview shows the top of a description before its
    "Show more"), then one table row per run (the fastest's throughput and the least memory in
    bold, a too-short run marked), then the verdict in full and how the numbers were taken: what
    `mlflow.note.content` holds, rendered as markdown on the run's Overview page."""
    fastest = {r.run_id for r in decision.fastest.runs} if decision.fastest else set()
    least = {r.run_id for c in decision.least_memory for r in c.runs}
    lines = [
        f"**{_md(decision.brief())}**",
        "",
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "|".join(":--" if i < 2 else "--:" for i in range(len(MARKDOWN_COLUMNS))) + "|",
    ]
    for r in rows:
        tokens = _spread(r.tokens_per_s, r.tokens_per_s_p10, r.tokens_per_s_p90, ",.0f")
        memory = _num(r.peak_memory_bytes / MiB, ",.2f")
        cells = (
            _md(r.name),
            r.strategy,
            r.world_size,
            f"**{tokens}**" if r.run_id in fastest else tokens,
            _num(r.step_ms, ".1f"),
            f"**{memory}**" if r.run_id in least else memory,
            _num(r.bytes_per_step / MiB, ".2f"),
            _num(r.final_loss, ".4f"),
            r.status + (", too short or noisy" if r.too_short else ""),
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {_md(n)}" for n in decision.lines() + notes)]
    lines += ["", f"_{_md(head)}. Plots: {', '.join(PLOTS)} (Artifacts); the table as "
              "report/report.csv._"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    """Text in a markdown table cell or line: pipes and `*` escaped (an underscore inside a word
    is literal in GitHub-flavoured markdown, as MLflow renders it)."""
    return text.replace("|", "\\|").replace("*", "\\*")


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
    notes = table_notes(rows)
    below = "\n".join(notes + [""] + decision.lines())
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
        log_to_parent(client, parent.info.run_id, files, markdown_note(head, rows, decision, notes))
        tag_verdict(client, parent, decision)
    print(
        f"report: {out} ({', '.join(Path(f).name for f in files)})"
        + (
            f", also logged to run {parent.info.run_id} (its description holds the table)"
            if parent
            else ""
        ),  # fmt: skip
        flush=True,
    )
    return Report(parent.info.run_id if parent else None, rows, table, decision, files)


def log_to_parent(client, run_id: str, files: list[str], note: str) -> None:
    """The description, the table's files under report/, the plots at the root and as images."""
    client.set_tag(run_id, NOTE_TAG, note)
    for path in files:
        name = Path(path).name
        client.log_artifact(run_id, path, artifact_path=None if name in PLOTS else "report")
        if name in IMAGE_KEYS:
            client.log_image(run_id, _image(path), key=IMAGE_KEYS[name], step=0)


def _image(path: str):
    from PIL import Image  # noqa: PLC0415 -- only to log the plots (MLflow's own dependency)

    with Image.open(path) as image:
        return image.convert("RGB")


def tag_verdict(client, parent, decision: Verdict) -> None:
    """sweep/* tags of the verdict; a sweep/winner left by an earlier report that no longer
    holds is deleted, as is its metric."""
    run_id = parent.info.run_id
    tags = verdict_tags(decision)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    for key in WINNER_TAGS:
        if key not in tags and key in parent.data.tags:
            client.delete_tag(run_id, key)
    if decision.fastest is not None:
        client.log_metric(run_id, "sweep/winner_tokens_per_s_median", decision.fastest.tokens_per_s)


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
