"""The runs of a sweep side by side: which runs, what each measured, which is fastest and
whether that can be told (the numbers of cluster/tracking/summary.py, from each run's history).

    parent, children = find_runs(client, "elastic-fsdp")     # a parent run id or an experiment
    rows = [summarize(client, run) for run in children]
    decision = verdict(rows)              # decision.headline(): "fastest: ..." or "no ranking: ..."

`python -m cluster.report` prints, writes and logs them (cluster/report.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from cluster.tracking.summary import Spread, percentile, run_stats


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
    too_short_reason: str = ""
    """Why this run is too short or too noisy to rank strategies; empty when it is not."""
    config: str = ""
    """The job's swept values without its repeat ('sharding=no_shard'): the repeats of one
    configuration share it (the sweep.config tag; the run name for runs without one)."""

    @property
    def too_short(self) -> bool:
        return bool(self.too_short_reason)

    @property
    def tokens(self) -> Spread:
        return Spread(self.tokens_per_s, self.tokens_per_s_p10, self.tokens_per_s_p90)

    @property
    def ranked(self) -> bool:
        """Finished with a measured throughput: a run the verdict can weigh."""
        return self.status == "FINISHED" and not math.isnan(self.tokens_per_s)


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
        too_short_reason=stats.too_short() or "",
        config=tags.get("sweep.config") or run.info.run_name or run.info.run_id[:8],
    )


# ---- which is fastest, which needs least memory, and can it be told ----------------------------


@dataclass
class Candidate:
    """One configuration of a sweep (its swept values) with its finished runs: one, or one per
    repeat (sweep.repeats)."""

    config: str
    runs: list
    """Its finished runs with a measured throughput, in job order."""

    @property
    def strategy(self) -> str:
        return self.runs[0].strategy

    @property
    def tokens_per_s(self) -> float:
        """The median of its runs' medians."""
        return percentile([r.tokens_per_s for r in self.runs], 50)

    @property
    def noise(self) -> tuple[float, float]:
        """The throughput range its rank must clear: with repeats, the lowest and highest of
        their medians (what repeating told, machine load included); of one run, its per-step
        tokens/s p10-p90."""
        if len(self.runs) > 1:
            medians = [r.tokens_per_s for r in self.runs]
            return min(medians), max(medians)
        return self.runs[0].tokens_per_s_p10, self.runs[0].tokens_per_s_p90

    @property
    def noise_name(self) -> str:
        return f"range of {len(self.runs)} repeats' medians" if len(self.runs) > 1 else "p10-p90"

    @property
    def peak_memory_bytes(self) -> float:
        return max(r.peak_memory_bytes for r in self.runs)

    def describe(self) -> str:
        lo, hi = self.noise
        rate = f"{self.tokens_per_s:,.0f} tokens/s"
        return f"{self.config} {rate} ({self.noise_name} {lo:,.0f}-{hi:,.0f})"


MEMORY_TIE = 0.01
"""Peaks closer than this fraction of the smaller one are a tie."""


@dataclass
class Verdict:
    fastest: Optional[Candidate]
    """The configuration with the highest median tokens/s, when that can be told; else None and
    `no_ranking` says why."""
    no_ranking: str
    least_memory: list
    """The configurations with the lowest accounted peak per rank (more than one: a tie)."""
    too_short: list
    """Runs too short or too noisy to rank strategies (RunSummary.too_short_reason)."""
    candidates: list

    @property
    def winner(self) -> Optional[RunSummary]:
        """The fastest configuration's first run (its row), or None."""
        return self.fastest.runs[0] if self.fastest else None

    def headline(self) -> str:
        """'fastest: ...' or 'no ranking: <why>'."""
        if self.fastest is None:
            return f"no ranking: {self.no_ranking}"
        return f"fastest: {self.fastest.describe()}, clear of every other configuration"

    def brief(self) -> str:
        """The verdict in one short line (the top of the parent's description): 'fastest: X
        (1,500 tokens/s) · least memory: Y (1.22 MiB/rank)' or 'no ranking (why, briefly) · ...'."""
        if self.fastest is None:
            short = len(self.too_short)
            why = (
                f"{short} of {sum(len(c.runs) for c in self.candidates)} runs too short or noisy"
                if short and len(self.candidates) > 1
                else "within the noise"
                if "overlaps" in self.no_ranking
                else "nothing to rank"
            )
            fastest = f"no ranking ({why})"
        else:
            fastest = f"fastest: {self.fastest.config} ({self.fastest.tokens_per_s:,.0f} tokens/s)"
        if not self.least_memory:
            return fastest
        names = " and ".join(c.config for c in self.least_memory)
        mib = self.least_memory[0].peak_memory_bytes / 2**20
        return f"{fastest} · least memory: {names} ({mib:,.2f} MiB/rank)"

    def memory_line(self) -> str:
        if not self.least_memory:
            return "least memory: none (no finished run logged its peak)"
        mib = self.least_memory[0].peak_memory_bytes / 2**20
        names = " and ".join(c.config for c in self.least_memory)
        tie = " (a tie)" if len(self.least_memory) > 1 else ""
        return f"least memory: {names}{tie}, {mib:,.2f} MiB peak per rank (mem/peak_total_bytes)"

    def lines(self) -> list[str]:
        """What the table alone does not say: the verdict, and each run that cannot rank."""
        lines = [self.headline(), self.memory_line()]
        for r in self.too_short:
            lines.append(f"too short: {r.name}: {r.too_short_reason}")
        return lines


def candidates_of(rows: list[RunSummary]) -> list[Candidate]:
    """The configurations with at least one finished run, in first-run order."""
    groups: dict[str, list] = {}
    for r in rows:
        if r.ranked:
            groups.setdefault(r.config or r.name, []).append(r)
    return [Candidate(config, runs) for config, runs in groups.items()]


def verdict(rows: list[RunSummary]) -> Verdict:
    """Name the fastest configuration only when the numbers can tell it: every run long and
    steady enough (none too short), and the fastest's throughput range clear of every other's
    (no overlap). The least memory is the lowest accounted peak (deterministic: no noise)."""
    cands = candidates_of(rows)
    short = [r for r in rows if r.too_short]
    least = _least_memory(cands)
    why = _why_no_ranking(cands, short)
    if why:
        return Verdict(None, why, least, short, cands)
    fastest = max(cands, key=lambda c: c.tokens_per_s)
    return Verdict(fastest, "", least, short, cands)


def _why_no_ranking(cands: list[Candidate], short: list[RunSummary]) -> str:
    if not cands:
        return "no run finished with a measured tokens/s"
    if len(cands) == 1:
        return f"only {cands[0].config} finished with a measured tokens/s: nothing to rank against"
    repeated = any(len(c.runs) > 1 for c in cands)
    advice = "" if repeated else ", or repeat each job in rotation (+sweep.repeats=3)"
    if short:
        names = ", ".join(r.name for r in short)
        return (
            f"{len(short)} run{'s are' if len(short) > 1 else ' is'} too short or too noisy to "
            f"rank strategies ({names}); measure more steps (train.steps) on a machine doing "
            f"nothing else{advice}"
        )
    top = max(cands, key=lambda c: c.tokens_per_s)
    lo, hi = top.noise
    close = [c for c in cands if c is not top and c.noise[0] <= hi and lo <= c.noise[1]]
    if close:
        others = "; ".join(c.describe() for c in close)
        return (
            f"the throughput of {top.describe()} overlaps {others}: the difference is within "
            f"the noise; measure more steps{advice}"
        )
    return ""


def _least_memory(cands: list[Candidate]) -> list[Candidate]:
    measured = [c for c in cands if not math.isnan(c.peak_memory_bytes)]
    if not measured:
        return []
    low = min(c.peak_memory_bytes for c in measured)
    return [c for c in measured if c.peak_memory_bytes <= low * (1 + MEMORY_TIE)]


WINNER_TAGS = ("sweep/winner", "sweep/winner_strategy", "sweep/winner_run_id")


def verdict_tags(v: Verdict) -> dict[str, str]:
    """The parent run's sweep/* tags: the verdict in words; sweep/winner (with its strategy and
    run ids) only when a fastest could be told."""
    tags = {
        "sweep/verdict": v.headline()[:5000],
        "sweep/least_memory": " and ".join(c.config for c in v.least_memory) or "none",
        "sweep/too_short": "true" if v.too_short else "false",
    }
    if v.fastest is not None:
        tags["sweep/winner"] = v.fastest.config
        tags["sweep/winner_strategy"] = v.fastest.strategy
        tags["sweep/winner_run_id"] = ",".join(r.run_id for r in v.fastest.runs)
    return tags
