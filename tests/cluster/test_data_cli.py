"""The real data path through the real CLIs: bad data input stops before anything starts;
`python -m cluster.prepare` tokenizes on Ray Data (2 CPUs) into the same bytes as one process;
`python -m cluster.train` on JSONL with a trained tokenizer logs eval/loss and data/* to MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.cluster.conftest import REPO, run_cli
from tests.cluster.test_config_errors import assert_failed_before_start
from trainer.checkpoint import CheckpointWriter, TensorChunk
from trainer.checkpoint.trainer_state import model_digest
from trainer.config import DataConfig, model_config
from trainer.data import PreparedData, prepare, train_tokenizer

WORDS = "alpha beta gamma delta epsilon the of and to in is it".split()


def docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        f"Document {i}: " + " ".join(rng.choice(WORDS, rng.integers(20, 80))) + "."
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Four JSONL files (four work units) and a BPE tokenizer trained on them."""
    root = tmp_path_factory.mktemp("jsonl")
    for k in range(4):
        with open(root / f"part-{k}.jsonl", "w") as f:
            for d in docs(150, seed=k):
                f.write(json.dumps({"text": d, "id": k}) + "\n")
    (root / "tokenizer.json").write_text(
        train_tokenizer([d for k in range(4) for d in docs(150, seed=k)], 400).to_str()
    )
    return root


def data_args(corpus: Path, *extra: str) -> list[str]:
    return [
        "data=jsonl",
        f"data.source={corpus}/*.jsonl",
        f"data.tokenizer={corpus}/tokenizer.json",
        "model.vocab_size=400",
        "data.seq_len=32",
        *extra,
    ]


def test_a_missing_text_column_names_it_before_anything_starts(launch_dir, corpus):
    result = run_cli(launch_dir, *data_args(corpus, "data.text_column=body"))
    assert_failed_before_start(
        result, launch_dir, "data.text_column='body'", "part-0.jsonl", "valid: one of 'id', 'text'"
    )


def test_an_empty_source_fails_before_anything_starts(launch_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli(launch_dir, "data=text", f"data.source={tmp_path / 'empty'}")
    assert_failed_before_start(result, launch_dir, "data.source=", "found no files")


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_a_missing_or_corrupt_tokenizer_fails_before_anything_starts(
    launch_dir, corpus, tmp_path, kind
):
    tok = tmp_path / "tok.json"
    if kind == "corrupt":
        tok.write_text((corpus / "tokenizer.json").read_text()[:300])
    result = run_cli(launch_dir, "data=jsonl", f"data.source={corpus}", f"data.tokenizer={tok}")
    expected = "cannot be read" if kind == "missing" else "not a readable tokenizer.json"
    assert_failed_before_start(result, launch_dir, f"data.tokenizer='{tok}'", expected)


def test_a_vocabulary_larger_than_the_model_names_both_numbers(launch_dir, corpus):
    result = run_cli(launch_dir, *data_args(corpus), "model.vocab_size=256")
    assert_failed_before_start(
        result,
        launch_dir,
        "model.vocab_size=256 is smaller than the tokenizer's vocabulary of 400",
        "valid: model.vocab_size >= 400",
    )


def test_resuming_on_changed_data_fails_before_anything_starts_and_says_what_to_do(
    launch_dir, corpus
):
    """A committed checkpoint of this run, trained on other prepared data (another digest)."""
    model = model_config("tiny", vocab_size=400)
    state = {
        "step": 3,
        "global_batch_size": 8,
        "optim_step": 3.0,
        "model_digest": model_digest(model),
        "model_config": {},
        "data": {"digest": "f" * 64, "seq_len": 32, "seed": 0, "weights": [1.0]},
    }
    chunks = [TensorChunk("model/x", (4,), torch.float32, 0, torch.zeros(4))]
    with CheckpointWriter(str(launch_dir / "runs" / "elastic-fsdp" / "checkpoints")) as w:
        w.save(3, 0, 1, chunks, state)
    result = run_cli(launch_dir, *data_args(corpus))
    assert result.returncode != 0, result.output
    for text in ("trained on other data", "digest: 'ffff", "a new cluster.run_name"):
        assert text in result.output, result.output
    assert (
        "started a local Ray for this job" not in result.output
        and "mlflow: run" not in result.output
    )


def test_prepare_on_ray_data_writes_the_same_bytes_as_one_process(corpus, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    ray_dir = tmp_path / "ray_prepared"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.prepare",
            f"hydra.run.dir={tmp_path}/outputs",
            *data_args(corpus),
            f"data.prepared_dir={ray_dir}",
            "data.eval_fraction=0.1",
            "cluster.num_workers=1",
            "cluster.cpus_per_worker=1.0",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert (
        "4 units on Ray Data, 2 tokenizer actor(s)" in out
        and "python -m trainer.data inspect" in out
    )
    local = prepare(
        DataConfig(
            source=f"{corpus}/*.jsonl",
            format="jsonl",
            tokenizer=f"{corpus}/tokenizer.json",
            prepared_dir=str(tmp_path / "local"),
            eval_fraction=0.1,
        )
    )
    ray_data = PreparedData.open(str(ray_dir / local.digest[:16]))
    assert ray_data.digest == local.digest  # the same preparation
    shards = sorted(p.name for p in Path(local.uri).glob("*.bin"))
    assert len(shards) == 8
    for name in shards:
        assert (Path(local.uri) / name).read_bytes() == (
            ray_dir / local.digest[:16] / name
        ).read_bytes()


@pytest.fixture(scope="module")
def tokenized_run(tmp_path_factory, corpus):
    launch_dir = tmp_path_factory.mktemp("tokenized")
    result = run_cli(
        launch_dir,
        *data_args(
            corpus,
            "data.eval_fraction=0.1",
            "data.eval_sequences=8",
            "train.eval_every=3",
            "train.steps=6",
            "train.checkpoint_every=3",
            "cluster.run_name=tok",
            "tracking.experiment=tok",
        ),
        timeout=240,
        env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"},
    )
    assert result.returncode == 0, result.output[-6000:]
    return launch_dir, result.output


def test_a_tokenized_run_logs_eval_loss_and_the_data_it_trained_on(tokenized_run):
    launch_dir, output = tokenized_run
    assert "| eval " in output and "(prepared now)" in output
    client = MlflowClient(f"sqlite:///{launch_dir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("tok").experiment_id])
    evals = [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")]
    assert evals == [3, 6]  # step N = N steps done
    ppl = client.get_metric_history(run.info.run_id, "eval/perplexity")
    loss = client.get_metric_history(run.info.run_id, "eval/loss")
    assert ppl[-1].value == pytest.approx(np.exp(loss[-1].value), rel=1e-6)
    assert run.data.tags["data.digest"] and run.data.tags["data.dir"].startswith(str(launch_dir))
    assert run.data.metrics["data/documents"] == 600 and run.data.metrics["data/tokens"] > 0
