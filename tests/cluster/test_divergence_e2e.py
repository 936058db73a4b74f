"""A diverging run through the real CLI: the workers stop at train.max_bad_steps non-finite steps
in a row, Ray does not retry it (a restart would repeat it), the driver exits 1 naming the steps,
the MLflow run is FAILED, and no checkpoint after the last good step exists."""

from __future__ import annotations

import json

from mlflow.tracking import MlflowClient

from tests.cluster.conftest import run_cli
from trainer.checkpoint import list_checkpoints


def test_a_diverging_run_stops_once_with_its_reason_and_keeps_only_finite_checkpoints(
    launch_dir,
):
    result = run_cli(
        launch_dir,
        "train.steps=12",
        "train.checkpoint_every=2",
        "train.global_batch_size=4",
        "train.max_bad_steps=2",
        "optim.lr=1e30",  # finite, so the config takes it; the first update overflows the model
        "optim.warmup_steps=0",
        "data.max_bytes=200000",
        "data.seq_len=32",
        "cluster.num_workers=2",
        "cluster.max_failures=2",
        "cluster.run_name=diverge",
        "tracking.experiment=diverge",
        timeout=240,
        env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"},
    )
    out = result.output
    assert result.returncode == 1, out[-6000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and "DivergenceError" in errors[-1], out[-6000:]
    print("\n" + errors[-1])
    run_dir = launch_dir / "runs" / "diverge"
    # One worker-group start: the error was not retried (cluster.max_failures=2 would allow 3).
    assert len(list((run_dir / "elastic" / "attempts").iterdir())) == 1
    fatal = json.loads((run_dir / "elastic" / "fatal.json").read_text())
    assert fatal["type"] == "DivergenceError"
    # Whatever was saved is finite; nothing was saved from the diverged state.
    for c in list_checkpoints(str(run_dir / "checkpoints")):
        assert c.problem is None
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("diverge").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.metrics["train/bad_steps"] >= 1
