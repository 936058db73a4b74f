"""trainer.metrics.NodeMetrics: system metrics with enough samples to mean something, or none.

The interval comes from the run's remaining time at its first logged step after step 1; a real
MLflow store takes the samples of a real monitor, the first of them a real CPU figure (MLflow's
own first sample is psutil's 0.0)."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from cluster.config import JobConfig
from cluster.tracking.runs import create_run
from trainer.metrics import NodeMetrics


class Started:
    """A stand-in for start_system_metrics that records how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, uri, run_id, node_id, interval_s):
        self.calls.append(interval_s)
        return self

    def finish(self):
        pass


@pytest.mark.parametrize(
    "total_steps, step_ms, interval",
    [
        (2000, 1000.0, 30.0),  # 33 min left: capped at 30 s
        (2000, 50.0, 1998 * 0.05 / 30),  # 99.9 s left: 3.33 s apart
        (60, 500.0, 1.0),  # 29 s left: 1 s apart, 29 samples
        (12, 1000.0, None),  # 10 s left: 10 samples of 1 s: the least taken
        (11, 1000.0, None),  # 9 s: off
    ],
)
def test_the_interval_follows_the_time_left(total_steps, step_ms, interval):
    started = Started()
    node = NodeMetrics("uri", "run", "n", total_steps, start=started)
    node.on_step(1, {"perf/step_ms": 10.0})  # step 1 carries start-up: not used
    assert node.decided is None and started.calls == []
    node.on_step(2, {"perf/step_ms": step_ms})
    if total_steps == 12:
        assert started.calls == [1.0]
        return
    if interval is None:
        assert started.calls == [] and node.decided.startswith("off: about 9 s")
    else:
        assert started.calls == [pytest.approx(interval)]
        assert node.decided.startswith(f"every {interval:.1f} s from step 2")
    node.on_step(3, {"perf/step_ms": 1.0})
    assert len(started.calls) <= 1, "decided once"


def test_an_explicit_interval_starts_at_once_and_zero_turns_them_off():
    started = Started()
    NodeMetrics("uri", "run", "n", 10, interval_s=0.5, start=started).on_step(1, {})
    assert started.calls == [0.5]
    off = NodeMetrics("uri", "run", "n", 10_000, interval_s=0.0, start=started)
    off.on_step(5, {"perf/step_ms": 1000.0})
    assert started.calls == [0.5] and off.decided == "off: tracking.system_metrics_interval_s=0"


def test_a_real_monitor_logs_several_samples_and_a_real_first_cpu_figure(tmp_path):
    store = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = create_run(JobConfig(), store)
    node = NodeMetrics(store, run_id, "10.0.0.9", total_steps=1000, interval_s=0.2, tag=True)
    node.on_step(1, {})
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:  # CPU work while the first samples are taken
        sum(i * i for i in range(10_000))
    client = MlflowClient(store)
    key = "system/10.0.0.9/cpu_utilization_percentage"
    deadline = time.monotonic() + 30
    while len(client.get_metric_history(run_id, key)) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)  # the monitor's own thread logs; nothing to wait on but the store
    node.finish()
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    assert len(history) >= 4
    assert history[0].value > 0.0, "the first sample is a measured figure, not psutil's 0.0"
    assert client.get_run(run_id).data.tags["system_metrics"] == "every 0.2 s from step 1"


def test_a_bad_interval_is_refused_naming_the_value():
    cfg = JobConfig()
    cfg.tracking.system_metrics_interval_s = -1.0
    with pytest.raises(ValueError, match=r"tracking.system_metrics_interval_s=-1.0.*0 \(off\)"):
        cfg.validate()
