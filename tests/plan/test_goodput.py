"""The goodput model (trainer/plan/goodput.py): the failure rate is the Llama 3 report's, the
intervals it picks agree with the Young/Daly optimum, an interval is never shorter than the save
it waits for, and the table says what spares and in-memory snapshots are worth. Pure arithmetic.
"""

from __future__ import annotations

import math

import pytest

from trainer.plan.goodput import (
    FAILURES_PER_GPU_HOUR,
    RESTART_NEW_S,
    RESTART_SPARES_S,
    Recovery,
    goodput_table,
    plan_goodput,
)
from trainer.plan.hardware import hardware

H100 = hardware("h100")
STATE = 207e6  # Llama 3 70B's master + moments on each of 4,096 ranks (12 bytes x 70.6B / 4096)


def test_the_failure_rate_is_419_unexpected_interruptions_in_54_days_on_16384_gpus():
    assert FAILURES_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))
    g = plan_goodput(6.0, 16384, STATE, H100)
    assert g.mtbf_s / 3600 == pytest.approx(54 * 24 / 419)  # one every ~3.1 h
    assert plan_goodput(6.0, 4096, STATE, H100).mtbf_s == pytest.approx(4 * g.mtbf_s)


def test_the_intervals_agree_with_the_young_daly_optimum():
    g = plan_goodput(6.0, 4096, STATE, H100)
    for every, optimum in (
        (g.snapshot_every, g.young_daly_snapshot_s),
        (g.checkpoint_every, g.young_daly_checkpoint_s),
    ):
        assert abs(every * 6.0 - optimum) <= 6.0 + 0.05 * optimum, (every, optimum)
    # a snapshot covers the failures that leave a copy: durable checkpoints are rarer
    assert g.checkpoint_every > g.snapshot_every
    assert 0.99 < g.goodput < 1


def test_an_interval_is_never_shorter_than_the_save_it_waits_for():
    slow = Recovery(storage_gbs=1.0)  # 4,096 x 207 MB through 1 GB/s: 848 s a checkpoint
    g = plan_goodput(6.0, 4096, STATE, H100, slow)
    assert g.checkpoint_every * 6.0 >= 4096 * STATE / 1e9
    assert g.checkpoint_every > plan_goodput(6.0, 4096, STATE, H100).checkpoint_every


def test_each_failure_costs_the_restart_measured_with_or_without_spares():
    base = plan_goodput(6.0, 4096, STATE, H100)
    new = plan_goodput(6.0, 4096, STATE, H100, Recovery(spares=False))
    added = new.lost_per_failure_s - base.lost_per_failure_s
    assert added == pytest.approx(RESTART_NEW_S - RESTART_SPARES_S, rel=0.05)
    assert new.goodput < base.goodput


def test_snapshots_are_worth_most_where_the_store_is_slow():
    rows = {row.label.split(" (")[0]: row for row in goodput_table(6.0, 4096, 3.3e9, H100)}
    ours, durable = rows["spares and in-memory snapshots"], rows["no in-memory snapshots"]
    assert ours.goodput.snapshot_every > 0 and durable.goodput.snapshot_every == 0
    slow_store = 0  # the SENSITIVITY column of a 10 GB/s store
    gain = ours.columns[slow_store].goodput - durable.columns[slow_store].goodput
    assert gain > 0.01  # points of goodput at 3.3 GB a rank
    assert ours.columns[1].goodput < ours.goodput.goodput  # a 10-minute restart costs it


def test_tokens_a_day_follow_goodput_and_the_step():
    g = plan_goodput(6.0, 4096, STATE, H100)
    assert g.tokens_per_day(4096 * 4096) == pytest.approx(g.goodput * 4096 * 4096 / 6 * 86400)
    never = plan_goodput(6.0, 4096, STATE, H100, Recovery(failures_per_gpu_hour=0.0))
    assert never.goodput > 0.9999 and math.isinf(never.mtbf_s)  # nothing fails: no protection
