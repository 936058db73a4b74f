"""The real entry point, end to end: local Ray, 2 CPU workers (gloo), the tiny model, a few steps.

One Ray start-up (~30 s here) covers everything issue 2 asks of `make run`: the loss fell, both
ranks wrote their shards of every committed checkpoint, Ray knows the last one, and MLflow holds
the run with the resolved config as params and one metric value per step.
"""

from __future__ import annotations

import os
import re

import pytest
from mlflow.tracking import MlflowClient

from tests.cluster.conftest import run_cli
from trainer.checkpoint import list_checkpoints
from trainer.checkpoint.format import data_file_name

STEPS = 8


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    launch_dir = tmp_path_factory.mktemp("e2e")
    result = run_cli(
        launch_dir,
        f"train.steps={STEPS}",
        "train.checkpoint_every=4",
        "train.global_batch_size=8",
        "optim.warmup_steps=2",
        "data.max_bytes=2000000",
        "data.seq_len=64",
        "cluster.num_workers=2",
        "cluster.run_name=e2e",
        "tracking.experiment=e2e",
        timeout=240,
        env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"},
    )
    assert result.returncode == 0, result.output[-6000:]
    return launch_dir, result.output


def test_run_prints_where_the_checkpoint_and_the_mlflow_run_are(finished_run):
    launch_dir, output = finished_run
    store = f"sqlite:///{launch_dir}/mlflow.db"
    assert "== done ==" in output
    assert f"checkpoint: {launch_dir}/runs/e2e/checkpoints/" in output
    assert f"tracking URI {store}" in output
    assert f"ui --backend-store-uri {store}" in output


def test_both_workers_wrote_their_shards_of_every_committed_checkpoint(finished_run):
    launch_dir, _ = finished_run
    checkpoints = list_checkpoints(f"{launch_dir}/runs/e2e/checkpoints")
    assert [c.step for c in checkpoints] == [STEPS, STEPS // 2]
    for c in checkpoints:
        assert c.problem is None, c
        for rank in (0, 1):
            assert os.path.getsize(f"{c.path}/{data_file_name(rank, 2)}") > 0


def test_ray_registered_the_last_checkpoint(finished_run):
    launch_dir, output = finished_run
    pointers = sorted(os.listdir(f"{launch_dir}/runs/e2e/ray_checkpoints"))
    assert pointers[-1].startswith(f"step_{STEPS:08d}_")
    assert re.search(rf"checkpoint: {launch_dir}/runs/e2e/checkpoints/step_0*{STEPS} ", output)


def test_mlflow_has_the_run_with_params_and_a_falling_loss(finished_run):
    launch_dir, _ = finished_run
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    experiment = client.get_experiment_by_name("e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["train.steps"], params["cluster.num_workers"]) == (str(STEPS), "2")
    assert params["sharding.strategy"] == "FULL_SHARD"
    assert params["data.prepared_dir"] == f"{launch_dir}/data/prepared"
    assert run.data.tags["checkpoint_root"] == f"{launch_dir}/runs/e2e/checkpoints"
    losses = [
        m.value
        for m in sorted(
            client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step
        )
    ]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0]
    for key in ("perf/tokens_per_s", "perf/step_ms", "train/lr"):
        assert len(client.get_metric_history(run.info.run_id, key)) == STEPS, key
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "resolved_config.yaml" in artifacts


def test_running_a_complete_run_again_says_so_at_once_and_opens_no_mlflow_run(finished_run):
    """A second `make run`: the run's newest checkpoint has every step asked for. It says so
    and what to change, in seconds, without Ray or a new (empty) MLflow run."""
    launch_dir, _ = finished_run
    args = [f"train.steps={STEPS}", "train.global_batch_size=8", "data.max_bytes=2000000"]
    args += ["data.seq_len=64", "cluster.run_name=e2e", "tracking.experiment=e2e"]
    again = run_cli(launch_dir, *args, timeout=60)
    assert again.returncode == 0, again.output[-3000:]
    assert f"run 'e2e' is complete: its checkpoint of step {STEPS}" in again.output
    assert f"train.steps={2 * STEPS}" in again.output and "cluster.run_name=e2e-2" in again.output
    assert "started a local Ray" not in again.output and "mlflow: run" not in again.output
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    experiment = client.get_experiment_by_name("e2e")
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_the_run_page_opens_on_loss_and_speed_and_the_run_has_a_telling_name(finished_run):
    """MLflow's run page sorts chart sections by prefix: 'At a glance' (loss, tokens/s per
    step) comes first; the runs list tells launches apart by name (issue 35)."""
    launch_dir, _ = finished_run
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert run.info.run_name == "FULL_SHARD x2 · tiny cpu · e2e"
    for glance, key in (("loss", "train/loss"), ("tokens_per_s", "perf/tokens_per_s")):
        ours = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        headline = client.get_metric_history(run.info.run_id, f"At a glance/{glance}")
        assert sorted((m.step, m.value) for m in headline) == sorted(ours) and len(ours) == STEPS
