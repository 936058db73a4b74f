"""What one run measured, in numbers that can rank strategies: medians and p10-p90 spreads over
the logged steps after a warm-up, from the run's own per-step metric history.

    stats = run_stats(lambda key: metric_history(uri, run_id, key))
    stats.metrics()          # {"Summary/tokens_per_s_median": ..., ...}: what finish_tracking logs
    stats.too_short()        # None, or why the run cannot rank strategies

The prefix is `Summary/`. (The MLflow UI draws a run's charts in one section per prefix and, once
any key arrives after its first layout, sorts the sections case-blind, so Summary is not first:
the run page opens on the loop's "At a glance" section, trainer/progress.py.) Summary/* values
are logged at step 0, one each: the UI draws them as bars.

The same numbers feed the sweep report (cluster/report.py), so the runs table of MLflow and the
report always agree. Nothing here imports MLflow: a history is any function of a metric key.

Warm-up: the first WARMUP_STEPS logged steps carry the first all-gathers, the allocator's growth
and (on GPU) kernel selection; they are left out of every median and percentile. A short run
leaves out at most half of its logged steps (rounded down), so one logged step is never left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

WARMUP_STEPS = 3
"""Logged steps left out at the start of a run (fewer when a run logged fewer than 6)."""
MIN_MEASURED_STEPS = 10
"""Fewer measured steps than this after the warm-up: too short to rank strategies."""
MAX_SPREAD = 0.20
"""A step-time p10-p90 spread wider than this fraction of its median: too noisy to rank."""
GiB, MiB = 2**30, 2**20
SUMMARY = "Summary/"
"""The prefix of a run's summary metrics and tags."""

History = Callable[[str], Sequence[tuple[int, float]]]
"""[(step, value)] of one metric key, sorted by step (cluster.tracking.runs.metric_history)."""


def warmup_count(logged: int) -> int:
    """How many of `logged` steps are warm-up: WARMUP_STEPS, at most half of them."""
    return min(WARMUP_STEPS, logged // 2)


def after_warmup(points: Sequence[tuple[int, float]]) -> list[float]:
    """The values after the warm-up, in step order."""
    points = sorted(points)
    return [v for _, v in points[warmup_count(len(points)) :]]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default); NaN of
    nothing."""
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = q / 100.0 * (len(xs) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Spread:
    """Median and p10-p90 of a metric's values after the warm-up."""

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(percentile(values, 50), percentile(values, 10), percentile(values, 90))

    @property
    def relative(self) -> float:
        """(p90 - p10) / median: how wide the middle 80% is against the typical value."""
        return (self.p90 - self.p10) / self.median if self.median else math.nan

    def overlaps(self, other: Spread) -> bool:
        """The two p10-p90 ranges share a value: their order is within the noise."""
        return self.p10 <= other.p90 and other.p10 <= self.p90


NO_SPREAD = Spread(math.nan, math.nan, math.nan)


@dataclass(frozen=True)
class RunStats:
    tokens_per_s: Spread
    step_ms: Spread
    tflops_per_worker: Spread
    mfu: Optional[Spread]
    """None when the run logged no perf/mfu (CPU, or a GPU whose peak the loop does not know)."""
    peak_memory_bytes: float
    """Max of mem/peak_total_bytes: the engine's accounted peak per rank, warm-up included."""
    device_peak_bytes: float
    """Max of mem/device_max_allocated_bytes (GPU runs; activations included); NaN on CPU."""
    rss_peak_bytes: float
    """Max of mem/rss_peak_bytes: rank 0's process resident-set high-water mark (CPU runs:
    everything the worker holds, not only tensors); NaN on GPU runs."""
    bytes_per_step: float
    """Median of comm/total_bytes after the warm-up: what one rank moves per step."""
    final_loss: float
    eval_loss: float
    """The last eval/loss; NaN when the run never evaluated."""
    steps_measured: int
    """Logged steps of perf/step_ms after the warm-up."""
    steps_warmup: int

    def too_short(self) -> Optional[str]:
        """Why these numbers cannot rank strategies (too few steps, or step times too spread),
        or None."""
        if self.steps_measured < MIN_MEASURED_STEPS:
            return (
                f"{self.steps_measured} steps measured after {self.steps_warmup} warm-up, "
                f"fewer than {MIN_MEASURED_STEPS}"
            )
        if self.step_ms.relative > MAX_SPREAD:
            return (
                f"step time p10-p90 {self.step_ms.p10:.1f}-{self.step_ms.p90:.1f} ms is "
                f"{self.step_ms.relative:.0%} of its median {self.step_ms.median:.1f} ms, "
                f"more than {MAX_SPREAD:.0%}"
            )
        return None

    def metrics(self) -> dict[str, float]:
        """Summary/* as logged to the run; a metric the run never logged is left out."""
        m = {}
        for name, spread in (("tokens_per_s", self.tokens_per_s), ("step_ms", self.step_ms)):
            m[f"{SUMMARY}{name}_median"] = spread.median
            m[f"{SUMMARY}{name}_p10"] = spread.p10
            m[f"{SUMMARY}{name}_p90"] = spread.p90
        m[f"{SUMMARY}tflops_median"] = self.tflops_per_worker.median
        if self.mfu is not None:
            m[f"{SUMMARY}mfu_median"] = self.mfu.median
        m[f"{SUMMARY}peak_memory_gib"] = self.peak_memory_bytes / GiB
        m[f"{SUMMARY}device_peak_memory_gib"] = self.device_peak_bytes / GiB
        m[f"{SUMMARY}rss_peak_gib"] = self.rss_peak_bytes / GiB
        m[f"{SUMMARY}bytes_per_step_mib"] = self.bytes_per_step / MiB
        m[f"{SUMMARY}final_loss"] = self.final_loss
        m[f"{SUMMARY}eval_loss"] = self.eval_loss
        m[f"{SUMMARY}steps_measured"] = float(self.steps_measured)
        m[f"{SUMMARY}steps_warmup"] = float(self.steps_warmup)
        return {k: v for k, v in m.items() if not math.isnan(v)}

    def tags(self) -> dict[str, str]:
        """Summary/too_short ("true"/"false") and, when true, Summary/too_short_reason."""
        reason = self.too_short()
        if reason is None:
            return {f"{SUMMARY}too_short": "false"}
        return {f"{SUMMARY}too_short": "true", f"{SUMMARY}too_short_reason": reason}


def run_stats(history: History) -> RunStats:
    """A run's summary from its per-step metric history."""
    step_ms = sorted(history("perf/step_ms"))
    mfu = after_warmup(history("perf/mfu"))
    loss = sorted(history("train/loss"))
    evals = sorted(history("eval/loss"))
    return RunStats(
        tokens_per_s=Spread.of(after_warmup(history("perf/tokens_per_s"))),
        step_ms=Spread.of(after_warmup(step_ms)),
        tflops_per_worker=Spread.of(after_warmup(history("perf/tflops_per_worker"))),
        mfu=Spread.of(mfu) if mfu else None,
        peak_memory_bytes=_max(history("mem/peak_total_bytes")),
        device_peak_bytes=_max(history("mem/device_max_allocated_bytes")),
        rss_peak_bytes=_max(history("mem/rss_peak_bytes")),
        bytes_per_step=percentile(after_warmup(history("comm/total_bytes")), 50),
        final_loss=loss[-1][1] if loss else math.nan,
        eval_loss=evals[-1][1] if evals else math.nan,
        steps_measured=len(step_ms) - warmup_count(len(step_ms)),
        steps_warmup=warmup_count(len(step_ms)),
    )


def _max(points: Sequence[tuple[int, float]]) -> float:
    return max((v for _, v in points), default=math.nan)


def describe(stats: RunStats) -> str:
    """One line: tokens/s and step time, median (p10-p90), over how many steps."""
    t, s = stats.tokens_per_s, stats.step_ms
    return (
        f"tokens/s {t.median:,.0f} (p10-p90 {t.p10:,.0f}-{t.p90:,.0f}), "
        f"step {s.median:.1f} ms (p10-p90 {s.p10:.1f}-{s.p90:.1f}), "
        f"medians over {stats.steps_measured} steps after {stats.steps_warmup} warm-up"
    )
