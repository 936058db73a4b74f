"""The Summary/* metrics a run ends with (cluster/tracking/summary.py, logged by
cluster/tracking/job.py), on a real sqlite MLflow store holding a known per-step history (no
Ray). The summaries of a real sweep's runs are checked in tests/cluster/test_sweep.py."""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from cluster.config import JobConfig
from cluster.tracking.job import finish_tracking, log_summary
from cluster.tracking.runs import create_run
from cluster.tracking.summary import (
    MAX_SPREAD,
    MIN_MEASURED_STEPS,
    WARMUP_STEPS,
    percentile,
    warmup_count,
)
from trainer.metrics import MLflowLogger

GiB, MiB = 2**30, 2**20


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('summary')}/mlflow.db"


def log_history(store: str, step_ms: list[float], extra=None) -> str:
    """A run whose step i took step_ms[i] and processed 100,000 tokens; the first WARMUP_STEPS
    steps also moved 100 MiB (first gathers), every later one 3 MiB."""
    run_id = create_run(JobConfig(), store)
    logger = MLflowLogger(store, run_id)
    for step, ms in enumerate(step_ms):
        m = {
            "train/loss": 5.0 - 0.1 * step,
            "perf/step_ms": ms,
            "perf/tokens_per_s": 100_000 / (ms / 1000.0),
            "perf/tflops_per_worker": 0.5 + 0.01 * step,
            "mem/peak_total_bytes": (1.0 + step / len(step_ms)) * GiB,
            "comm/total_bytes": (100.0 if step < WARMUP_STEPS else 3.0) * MiB,
        }
        m.update((extra or {}).get(step, {}))
        logger.log_metrics(m, step=step)
    return run_id


def summary_of(store: str, run_id: str) -> tuple[dict, dict]:
    run = MlflowClient(store).get_run(run_id)
    metrics = {k: v for k, v in run.data.metrics.items() if k.startswith("Summary/")}
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("Summary/")}
    return metrics, tags


def test_percentiles_are_linear_between_ranks_like_numpy():
    values = [float(v) for v in range(100, 112)]  # shuffled input must not matter
    assert percentile(values[::-1], 50) == pytest.approx(105.5)
    assert percentile(values, 10) == pytest.approx(101.1)
    assert percentile(values, 90) == pytest.approx(109.9)
    assert percentile([7.0], 10) == 7.0
    assert math.isnan(percentile([], 50))


def test_warmup_is_three_steps_at_most_half_and_never_every_step():
    assert WARMUP_STEPS == 3
    assert [warmup_count(n) for n in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert all(warmup_count(n) < n for n in range(1, 100))


def test_a_long_steady_run_logs_medians_and_spreads_after_the_warmup(store):
    # Three slow warm-up steps, then twelve steps of 100..111 ms.
    step_ms = [5000.0, 4000.0, 3000.0] + [100.0 + i for i in range(12)]
    extra = {s: {"perf/mfu": 0.25 + 0.01 * s} for s in range(15)}
    extra[4]["eval/loss"], extra[9]["eval/loss"] = 4.2, 3.9  # evaluated twice
    run_id = log_history(store, step_ms, extra)
    log_summary(store, run_id)
    metrics, tags = summary_of(store, run_id)
    tokens = sorted(100_000 / (ms / 1000.0) for ms in step_ms[3:])
    assert metrics == pytest.approx(
        {
            "Summary/step_ms_median": 105.5,
            "Summary/step_ms_p10": 101.1,
            "Summary/step_ms_p90": 109.9,
            "Summary/tokens_per_s_median": (tokens[5] + tokens[6]) / 2,
            "Summary/tokens_per_s_p10": tokens[1] + 0.1 * (tokens[2] - tokens[1]),
            "Summary/tokens_per_s_p90": tokens[9] + 0.9 * (tokens[10] - tokens[9]),
            "Summary/tflops_median": 0.5 + 0.01 * 8.5,  # steps 3..14: median step 8.5
            "Summary/mfu_median": 0.25 + 0.01 * 8.5,
            "Summary/peak_memory_gib": 1.0 + 14 / 15,  # the max, warm-up included
            "Summary/bytes_per_step_mib": 3.0,  # the warm-up's 100 MiB left out
            "Summary/final_loss": 5.0 - 0.1 * 14,
            "Summary/eval_loss": 3.9,  # the last evaluation
            "Summary/steps_measured": 12.0,
            "Summary/steps_warmup": 3.0,
        }
    )
    assert tags == {"Summary/too_short": "false"}
    history = MlflowClient(store).get_metric_history(run_id, "Summary/step_ms_median")
    assert [m.step for m in history] == [0]  # one value, at step 0: a bar in the UI, not a dot


def test_a_run_without_mfu_or_eval_logs_neither(store):
    run_id = log_history(store, [100.0] * 12)
    log_summary(store, run_id)
    metrics, _ = summary_of(store, run_id)
    assert "Summary/mfu_median" not in metrics and "Summary/eval_loss" not in metrics
    assert "Summary/device_peak_memory_gib" not in metrics  # a CPU run: no device memory
    assert metrics["Summary/step_ms_median"] == 100.0


def test_a_short_run_is_tagged_too_short_and_warned_of_only_where_runs_are_ranked(store, capsys):
    run_id = log_history(store, [900.0, 800.0, 100.0, 100.0, 100.0])
    log_summary(store, run_id)  # a single run: ranked against nothing, nothing to warn of
    assert "too short" not in capsys.readouterr().err
    log_summary(store, run_id, ranked=True)  # a sweep's job
    metrics, tags = summary_of(store, run_id)
    assert (metrics["Summary/steps_warmup"], metrics["Summary/steps_measured"]) == (2.0, 3.0)
    assert metrics["Summary/step_ms_median"] == 100.0  # the two slow ones were the warm-up
    assert tags["Summary/too_short"] == "true"
    assert tags["Summary/too_short_reason"] == (
        f"3 steps measured after 2 warm-up, fewer than {MIN_MEASURED_STEPS}"
    )
    assert "too short or too noisy to rank strategies" in capsys.readouterr().err


def test_a_noisy_run_is_tagged_too_short_naming_its_spread(store, capsys):
    run_id = log_history(store, [100.0, 200.0] * 10)  # p10 100, p90 200: 100% of the median
    log_summary(store, run_id, ranked=True)
    metrics, tags = summary_of(store, run_id)
    assert metrics["Summary/steps_measured"] == 17.0
    assert tags["Summary/too_short"] == "true"
    assert f"more than {MAX_SPREAD:.0%}" in tags["Summary/too_short_reason"]
    assert "too short or too noisy" in capsys.readouterr().err


def test_a_single_step_is_measured_not_left_out_as_warmup(store):
    run_id = log_history(store, [250.0])
    log_summary(store, run_id)
    metrics, tags = summary_of(store, run_id)
    assert metrics["Summary/steps_measured"] == 1.0 and metrics["Summary/steps_warmup"] == 0.0
    assert metrics["Summary/step_ms_median"] == metrics["Summary/step_ms_p90"] == 250.0
    assert tags["Summary/too_short"] == "true"


def test_a_run_that_logged_no_step_gets_no_summary(store):
    run_id = create_run(JobConfig(), store)
    assert log_summary(store, run_id) is None
    assert summary_of(store, run_id) == ({}, {})


def test_finish_tracking_logs_the_summary_before_it_ends_the_run(store, tmp_path):
    cfg = JobConfig()
    cfg.tracking.tracking_uri = store
    run_id = log_history(store, [100.0] * 13)
    finish_tracking(cfg, run_id, None, str(tmp_path), ok=True)
    run = MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["Summary/steps_measured"] == 10.0
    assert run.data.tags["Summary/too_short"] == "false"
