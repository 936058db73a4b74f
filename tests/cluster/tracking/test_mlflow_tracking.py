"""cluster/tracking/runs.py (the driver) and trainer/metrics.py (the workers) against a real
MLflow sqlite store in a tmp dir."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from cluster.config import JobConfig, flatten
from cluster.tracking.runs import (
    COMPARED_PARAMS,
    create_run,
    metric_history,
    resolve_tracking_uri,
    ui_command,
)
from trainer.metrics import (
    MAX_PARAM_VAL_LENGTH,
    MetricsLogger,
    MLflowLogger,
    NullLogger,
    param_value,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_relative_sqlite_uri_becomes_absolute_against_the_launch_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    base = str(tmp_path)
    assert resolve_tracking_uri("sqlite:///mlflow.db", base) == f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri("sqlite:///sub/m.db", base) == f"sqlite:///{tmp_path}/sub/m.db"
    assert resolve_tracking_uri("sqlite:////abs/m.db", base) == "sqlite:////abs/m.db"
    assert resolve_tracking_uri("mlruns", base) == str(tmp_path / "mlruns")
    assert resolve_tracking_uri("http://mlflow:5000", base) == "http://mlflow:5000"


def test_mlflow_tracking_uri_in_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert (
        resolve_tracking_uri("http://ignored:5000", str(tmp_path)) == f"sqlite:///{tmp_path}/env.db"
    )


def test_run_params_are_the_compared_keys_and_the_job_is_in_tags(store):
    """Params are what a user compares (COMPARED_PARAMS, set values only, and the keys a sweep
    varies); the whole resolved config is an artifact (cluster/tracking/job.py)."""
    cfg = JobConfig()
    cfg.sharding.strategy = "SHARD_GRAD_OP"
    cfg.tracking.experiment = "params-test"
    run_id = create_run(cfg, store, params_also=["optim.beta2"])
    run = MlflowClient(store).get_run(run_id)
    flat = flatten(cfg)
    expected = [k for k in COMPARED_PARAMS if flat[k] is not None and k != "data.train_on"]
    assert run.data.params == {k: str(flat[k]) for k in expected + ["optim.beta2"]}
    assert {"sharding.strategy", "model.name", "cluster.num_workers", "train.global_batch_size",
            "data.seq_len", "optim.lr", "sharding.param_dtype"} <= set(run.data.params)  # fmt: skip
    assert len(run.data.params) < 30  # not the ~100 keys of the whole config
    assert run.data.tags["strategy"] == "SHARD_GRAD_OP"
    assert (run.data.tags["world_size"], run.data.tags["device"]) == ("2", "cpu")
    # the runs list tells launches apart by what differs first (issue 35: two identical rows)
    assert run.info.run_name == "SHARD_GRAD_OP x2 · tiny cpu"
    experiment = MlflowClient(store).get_experiment(run.info.experiment_id)
    assert experiment.name == "params-test"
    assert create_run(cfg, store) != run_id  # same experiment, a new run
    cfg.cluster.run_name, cfg.cluster.min_workers, cfg.cluster.max_workers = "qwen-sft", 2, 8
    named = MlflowClient(store).get_run(create_run(cfg, store))
    assert named.info.run_name == "SHARD_GRAD_OP x2-8 · tiny cpu · qwen-sft"


def test_the_experiment_carries_a_runs_list_view_of_loss_speed_and_memory(store):
    """MLflow 3's runs list shows no metric by default; the experiment's saved view (the printed
    experiment URL opens it) shows each run's final loss, tokens/s, step time and memory."""
    import json

    from cluster.tracking.runs import VIEW_COLUMNS, VIEW_KEY, VIEW_TAG, ui_url

    run_id = create_run(JobConfig(), store)
    client = MlflowClient(store)
    experiment = client.get_experiment(client.get_run(run_id).info.experiment_id)
    view = json.loads(experiment.tags[VIEW_TAG])
    assert view["name"] == "Loss and speed"
    assert json.loads(view["state"])["selectedColumns"] == list(VIEW_COLUMNS)
    assert ui_url(store, experiment.experiment_id).endswith(f"&viewStateShareKey={VIEW_KEY}")
    assert "viewStateShareKey" not in ui_url(store, experiment.experiment_id, run_id)


def test_child_run_points_at_its_parent(store):
    cfg = JobConfig()
    cfg.cluster.min_workers, cfg.cluster.max_workers = 1, 4
    parent = create_run(cfg, store, run_name="sweep")
    child = create_run(cfg, store, parent_run_id=parent)
    tags = MlflowClient(store).get_run(child).data.tags
    assert tags["mlflow.parentRunId"] == parent and tags["world_size"] == "1-4"


def test_logger_attaches_to_the_drivers_run_and_logs_by_step(store, tmp_path):
    run_id = create_run(JobConfig(), store)
    logger = MLflowLogger(store, run_id)
    for step in (1, 2, 3):
        logger.log_metrics({"train/loss": 4.0 - step, "perf/step_ms": 10 * step}, step=step)
    logger.set_tags({"elastic/restarts": 0})
    (tmp_path / "note.txt").write_text("hello")
    logger.log_artifact(str(tmp_path / "note.txt"))
    logger.close()
    assert metric_history(store, run_id, "train/loss") == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [s for s, _ in metric_history(store, run_id, "perf/step_ms")] == [1, 2, 3]
    client = MlflowClient(store)
    assert client.get_run(run_id).data.tags["elastic/restarts"] == "0"
    assert [a.path for a in client.list_artifacts(run_id)] == ["note.txt"]
    db_dir = store[len("sqlite:///") :].rsplit("/", 1)[0]
    experiment = client.get_experiment(client.get_run(run_id).info.experiment_id)
    # next to the store, not in cwd
    assert experiment.artifact_location.endswith(f"{db_dir}/mlruns")
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) >= 1


def test_non_numeric_metric_is_refused_naming_the_key(store):
    logger = MLflowLogger(store, create_run(JobConfig(), store))
    with pytest.raises(TypeError, match="'train/loss'"):
        logger.log_metrics({"train/loss": "low"}, step=1)


def test_long_param_values_are_cut_to_mlflows_limit():
    assert param_value("x" * 10) == "x" * 10
    cut = param_value("y" * (MAX_PARAM_VAL_LENGTH + 50))
    assert len(cut) == MAX_PARAM_VAL_LENGTH and cut.endswith("...[truncated]")


def test_null_logger_is_a_metrics_logger_that_does_nothing():
    logger = NullLogger()
    assert isinstance(logger, MetricsLogger)
    assert isinstance(MLflowLogger.__new__(MLflowLogger), MetricsLogger)
    logger.log_metrics({"a": 1}, step=1)
    logger.close()


def test_ui_command_names_the_store():
    assert ui_command("sqlite:////x/mlflow.db").endswith(
        "ui --backend-store-uri sqlite:////x/mlflow.db"
    )
    assert "http://h:5000" in ui_command("http://h:5000")


def test_summary_metrics_sort_before_every_section_of_the_loop_and_the_engine():
    """The MLflow UI draws a run's charts in one section per prefix, sorted by code point: the
    Summary section must come first, before comm/, data/, elastic/, eval/, mem/, perf/, train/."""
    from cluster.tracking.summary import SUMMARY  # noqa: PLC0415 -- next to its test

    sections = ["comm", "data", "elastic", "eval", "mem", "perf", "system", "train", SUMMARY[:-1]]
    assert sorted(sections)[0] == "Summary"
