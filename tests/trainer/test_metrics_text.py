"""trainer.metrics' text artifacts: rank 0's MLflowLogger writes samples/step_N.txt into the run
(a real sqlite store and artifact folder in tmp_path), every other rank's NullLogger ignores it."""

from __future__ import annotations

import pytest

from trainer.metrics import MetricsLogger, MLflowLogger, NullLogger

mlflow = pytest.importorskip("mlflow")


def test_log_text_writes_the_run_artifact_and_a_later_step_its_own(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    logger = MLflowLogger(uri, run_id)
    assert isinstance(logger, MetricsLogger)
    logger.log_text("## sample 1\nhello ü\n", "samples/step_10.txt")
    logger.log_text("## sample 1\nlater\n", "samples/step_20.txt")
    listed = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert listed == ["samples/step_10.txt", "samples/step_20.txt"]
    local = client.download_artifacts(run_id, "samples/step_10.txt", str(tmp_path / "dl"))
    assert open(local, encoding="utf-8").read() == "## sample 1\nhello ü\n"


def test_the_null_logger_takes_text_and_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = NullLogger()
    assert isinstance(logger, MetricsLogger)
    logger.log_text("anything", "samples/step_1.txt")
    assert list(tmp_path.iterdir()) == []
