"""The runs of a sweep side by side: which runs, what each measured, which is fastest and
whether that can be told (the numbers of cluster/tracking/summary.py, from each run's history).

    parent, children = find_runs(client, "elastic-fsdp")     # a parent run id or an experiment
    rows = [summarize(client, run) for run in children]
    decision = verdict(rows)                                  # decision.lines(): what to say

`python -m cluster.report` prints, writes and logs them (cluster/report.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from cluster.tracking.summary import Spread, run_stats


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
    """A run's row, from its metric history with the warm-up rule of summary.py."""

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
