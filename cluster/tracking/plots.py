"""The plots of a run or a sweep, as PNG files of one size (matplotlib, imported only to plot).

    plot_loss_curves({"full_shard": [(1, 5.2), (2, 4.9)]}, "loss.png", "train/loss by run")
    plot_bars(["full_shard", "no_shard"], [1136.0, 1210.0], "tokens/s", "throughput", "t.png")

The report of a sweep (cluster/report.py) and each job's loss curve (cluster/tracking/job.py).
"""

from __future__ import annotations

import math
from typing import Optional

PLOT_SIZE_PX = (800, 500)
"""(width, height) of every PNG written here: 8 x 5 inches at 100 dpi."""
PLOT_DPI = 100


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
    marked: Optional[list[bool]] = None,
    marked_as: str = "too short to rank",
) -> str:
    """One bar per run; `ranges` [(p10, p90)] draws them as error bars around each value;
    `marked` bars are hatched, pale and named in a legend (`marked_as`)."""
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
    if marked and any(marked):
        for bar, mark in zip(bars, marked):
            if mark:
                bar.set_hatch("//")
                bar.set_alpha(0.45)
                bar.set_edgecolor("black")
        first = next(b for b, mark in zip(bars, marked) if mark)
        ax.legend([first], [f"hatched: {marked_as}"], fontsize="small", loc="lower right")
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


def _num(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)
