"""A launch that dies never leaves its MLflow run RUNNING: FAILED when it failed, KILLED when it
was interrupted (Ctrl-C, SIGTERM: `ray job stop`), with a real sqlite MLflow store.

The CLI case is the one where the run exists before Ray has said whether it holds the job: a
local Ray is started while MLflow's run is created in a thread (cluster/train.py TrackingStart),
and GPU workers on this CPU-only machine are then refused. The interrupted cases go through the
same function the driver's handler runs, in-process, against the same store.
"""

from __future__ import annotations

import dataclasses
import signal
import time

import pytest
from mlflow.tracking import MlflowClient

from cluster.config import JobConfig, TrackingConfig
from cluster.train import TrackingStart, end_unfinished
from tests.cluster.conftest import run_cli


def test_a_refused_local_launch_ends_its_mlflow_run_failed(launch_dir):
    start = time.monotonic()
    result = run_cli(
        launch_dir,
        "cluster.use_gpu=true",
        "cluster.num_workers=1",
        "data.max_bytes=200000",
        "data.seq_len=32",
        "tracking.experiment=refused",
        timeout=150,
    )
    seconds = time.monotonic() - start
    print(f"\nrc {result.returncode} in {seconds:.1f} s")
    assert result.returncode == 1, result.output[-4000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cluster.use_gpu=false (this cluster has no GPU)" in errors[0]
    assert "a local Ray started here" in errors[0]
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("refused").experiment_id])
    assert run.info.status == "FAILED"
    assert f"mlflow: run {run.info.run_id} marked FAILED" in result.output


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> JobConfig:
    uri = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"  # one store: set up once
    return dataclasses.replace(
        JobConfig(), tracking=TrackingConfig(tracking_uri=uri, experiment="ends")
    )


@pytest.mark.parametrize(
    "error, status",
    [
        (SystemExit(signal.SIGTERM), "KILLED"),  # ray.init's SIGTERM handler: sys.exit(15)
        (KeyboardInterrupt(), "KILLED"),
        (SystemExit(1), "FAILED"),  # our own exits: Ray unreachable or too small
        (RuntimeError("Ray went away"), "FAILED"),
    ],
)
def test_the_run_of_a_launch_that_dies_is_ended_killed_or_failed(cfg, tmp_path, error, status):
    tracking = TrackingStart(cfg, None, str(tmp_path))
    end_unfinished(cfg, tracking, None, error)
    run = MlflowClient(cfg.tracking.tracking_uri).get_run(tracking.run_id())
    assert run.info.status == status
