"""The prepared data's checks run on the driver, before Ray starts: a corpus too small for the
window (text: tokens; chat: conversations in windows) is one `error:` line through the real CLI
with advice that works, and the default data=parquet job on a small corpus passes them."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.preflight import checked_config, preflight
from tests.cluster.conftest import run_cli
from tests.cluster.test_preflight import assert_stopped_at_driver, composed
from tests.data.chat_templates import write_tokenizer

SMALL_MODEL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=64"]


@pytest.fixture(scope="module")
def small_parquet(tmp_path_factory) -> Path:
    """3,000 short documents (~157k byte tokens): the issue's 'few thousand documents'."""
    path = tmp_path_factory.mktemp("parquet") / "small.parquet"
    docs = [f"document {i}: a short line of text about item {i}." for i in range(3000)]
    pq.write_table(pa.table({"text": docs}), path)
    return path


def run_driver(launch_dir: Path, *overrides: str):
    """The real CLI; whether it started a Ray (its session folder under a fresh RAY_TMPDIR)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp")) / "ray"
    start = time.monotonic()
    try:
        result = run_cli(
            launch_dir,
            *overrides,
            f"tracking.tracking_uri=sqlite:///{launch_dir}/mlflow.db",
            timeout=150.0,
            env={"RAY_TMPDIR": str(ray_tmp)},
        )
        result.seconds = time.monotonic() - start
        result.ray_started = ray_tmp.exists()
    finally:
        shutil.rmtree(ray_tmp.parent, ignore_errors=True)
    return result


def parquet_job(source: Path, *extra: str) -> list[str]:
    return ["data=parquet", f"data.source={source}", "data.tokenizer=byte", *SMALL_MODEL, *extra]


def passes_preflight(launch_dir: Path, overrides: list[str]) -> None:
    cfg = checked_config(composed(overrides), str(launch_dir))
    preflight(cfg, log=lambda *_: None)


def test_an_eval_split_too_small_for_the_window_fails_before_ray_and_the_advice_works(
    launch_dir, small_parquet, monkeypatch
):
    """data=parquet's eval_fraction 0.001 holds out ~155 tokens: evaluating at seq_len 2048 is a
    preflight error that says to raise the fraction (not lower it); the value it names passes."""
    result = run_driver(launch_dir, *parquet_job(small_parquet, "train.eval_every=10"))
    line = assert_stopped_at_driver(
        result,
        launch_dir,
        "data.eval_fraction=0.001 holds out too little",
        "data.seq_len=2048",
        "less than one sequence of data.seq_len + 1 = 2,049 tokens",
        "train.eval_every=0",
    )
    assert "lower data.eval_fraction" not in line
    suggested = re.search(r"valid: data\.eval_fraction=([0-9.]+) or more", line).group(1)
    assert float(suggested) > 0.001
    monkeypatch.chdir(launch_dir)
    passes_preflight(launch_dir, parquet_job(small_parquet, "train.eval_every=10") + [
        f"data.eval_fraction={suggested}"
    ])  # fmt: skip


def test_the_default_parquet_job_on_a_small_corpus_passes_the_preflight(
    launch_dir, small_parquet, monkeypatch
):
    """No evaluation by default: the train split (~157k tokens) holds seq_len 2048 windows."""
    monkeypatch.chdir(launch_dir)
    passes_preflight(launch_dir, parquet_job(small_parquet))


def test_a_train_split_shorter_than_the_window_says_seq_len_or_max_bytes(launch_dir, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("a few words of plain text, again and again. " * 100)  # 4,500 bytes
    job = ["data=text", f"data.source={text}", "data.max_bytes=1500", "data.seq_len=2048"]
    result = run_driver(launch_dir, *job, "data.eval_fraction=0.01", "train.steps=1")
    line = assert_stopped_at_driver(
        result,
        launch_dir,
        "data.seq_len=2048 is longer than the train split",
        "valid: data.seq_len <= ",
        "raise data.max_bytes=1,500",
        "lower data.eval_fraction=0.01",
    )
    assert "raise data.eval_fraction" not in line


def test_a_chat_eval_split_without_a_conversation_talks_about_windows(launch_dir, tmp_path):
    tok = write_tokenizer(tmp_path / "tok", "qwen2.5")
    records = tmp_path / "chat.jsonl"
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"hi {i}"},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for i in range(20)
    ]
    records.write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = run_driver(
        launch_dir,
        "data=chat",
        f"data.source={records}",
        f"data.tokenizer={tok}",
        "data.seq_len=64",
        "data.eval_fraction=0.001",
        "train.eval_every=5",
        "model.vocab_size=512",
        *SMALL_MODEL,
    )
    line = assert_stopped_at_driver(
        result,
        launch_dir,
        "data.eval_fraction=0.001 holds out no conversation",
        "20 conversations in windows of 65 tokens",
        "no eval window",
        "train.eval_every=0",
    )
    assert "tokens (" not in line  # windows and conversations, not a token count
